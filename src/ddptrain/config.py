"""The run's configuration: one frozen dataclass, checked where it is built.

Runtime facts (rank, device, per-rank batch) live in `distributed.DistEnv`, never here.
"""

import dataclasses
import functools
from dataclasses import dataclass

from ddptrain.errors import UserError

DEVICES = ("auto", "cpu", "cuda", "mps", "xpu")
BACKENDS = ("gloo", "nccl", "xccl", "mpi", "ucc")
AMP = ("none", "bf16", "fp16")
BAD_IMAGES = ("error", "skip")
# PIL's own default limit (1024 * 1024 * 1024 // 4 // 3): about a 9,500 px square.
MAX_IMAGE_PIXELS = 89_478_485
# Train crop of the built-in dataset, whose images are 40 px; real data gets ImageNet's 224.
BUILTIN_IMAGE_SIZE = 32
DEFAULT_IMAGE_SIZE = 224


@functools.cache
def architectures() -> tuple[str, ...]:
    """Classification models torchvision builds by name (not helpers such as `get_model`)."""
    import torchvision

    return tuple(torchvision.models.list_models(module=torchvision.models))


@dataclass(frozen=True)
class Config:
    data: str | None = None
    arch: str = "resnet18"
    workers: int = 4
    epochs: int = 90
    start_epoch: int = 0
    batch_size: int = 256
    lr: float = 0.1
    momentum: float = 0.9
    weight_decay: float = 1e-4
    print_freq: int = 10
    resume: str | None = None
    evaluate: bool = False
    pretrained: bool = False
    world_size: int = -1
    rank: int = -1
    dist_url: str = "env://"
    dist_backend: str | None = None
    seed: int | None = None
    gpu: int | None = None
    multiprocessing_distributed: bool = False
    dummy: bool = False
    no_accel: bool = False
    out_dir: str = "."
    image_size: int | None = None
    nproc_per_node: int | None = None
    device: str = "auto"
    local_rank: int | None = None
    # Well below gloo's 30 minutes, so a stalled rank ends the others instead of the job; long
    # enough for rank 0 to download big weights or save a big checkpoint while others wait.
    dist_timeout: float = 600.0
    checkpoint_every: int = 0  # optimizer steps between mid-epoch checkpoints; 0: epoch ends only
    keep_last: int = 2  # numbered checkpoints kept, so a damaged newest one has a predecessor
    # None: the resumed checkpoint's setting, else none / on for convolutional models / off.
    amp: str | None = None
    channels_last: bool | None = None
    compile: bool | None = None
    # Bad images: decode every image before training (data/check.py); skip the bad ones
    # (implies the check) or stop; refuse headers declaring more pixels (decompression bombs).
    verify_images: bool = False
    bad_images: str = "error"
    max_image_pixels: int = MAX_IMAGE_PIXELS

    def __post_init__(self) -> None:
        if self.image_size is None:
            builtin = self.data is None and not self.dummy
            size = BUILTIN_IMAGE_SIZE if builtin else DEFAULT_IMAGE_SIZE
            object.__setattr__(self, "image_size", size)
        self._check()

    def _check(self) -> None:
        at_least = {
            "--workers": (self.workers, 0),
            "--epochs": (self.epochs, 0),
            "--start-epoch": (self.start_epoch, 0),
            "--batch-size": (self.batch_size, 1),
            "--print-freq": (self.print_freq, 1),
            "--image-size": (self.image_size, 16),
            "--dist-timeout": (self.dist_timeout, 1),
            "--checkpoint-every": (self.checkpoint_every, 0),
            "--keep-last": (self.keep_last, 1),
            "--max-image-pixels": (self.max_image_pixels, 1),
        }
        for flag, (value, low) in at_least.items():
            if value < low:
                raise UserError(f"{flag} must be at least {low}, got {value}")
        for flag, value in (("--lr", self.lr), ("--momentum", self.momentum)):
            if value < 0:
                raise UserError(f"{flag} must not be negative, got {value}")
        if self.weight_decay < 0:
            raise UserError(f"--weight-decay must not be negative, got {self.weight_decay}")
        if self.arch not in architectures():
            raise UserError(
                f"--arch: unknown architecture {self.arch!r}; choose one of: "
                + ", ".join(architectures())
            )
        if self.bad_images not in BAD_IMAGES:
            raise UserError(
                f"--bad-images must be one of {', '.join(BAD_IMAGES)}, got {self.bad_images!r}"
            )
        if self.amp is not None and self.amp not in AMP:
            raise UserError(f"--amp must be one of {', '.join(AMP)}, got {self.amp!r}")
        if self.device not in DEVICES:
            raise UserError(f"--device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.no_accel and self.device not in ("auto", "cpu"):
            raise UserError(f"--no-accel contradicts --device {self.device}")
        if self.gpu is not None and (self.gpu < 0 or self.no_accel or self.device == "cpu"):
            raise UserError(f"--gpu {self.gpu} needs an accelerator device and an index >= 0")
        if self.dist_backend is not None and self.dist_backend not in BACKENDS:
            raise UserError(
                f"--dist-backend must be one of {', '.join(BACKENDS)}, got {self.dist_backend!r}"
            )
        if not self.dist_url.startswith(("env://", "tcp://", "file://")):
            raise UserError(
                f"--dist-url must start with env://, tcp:// or file://: {self.dist_url}"
            )
        if self.world_size == 0 or self.world_size < -1:
            raise UserError(f"--world-size must be at least 1, got {self.world_size}")
        if self.world_size > 0 and self.rank >= self.world_size:
            raise UserError(f"--rank {self.rank} must be below --world-size {self.world_size}")
        if self.nproc_per_node is not None and self.nproc_per_node < 1:
            raise UserError(f"--nproc-per-node must be at least 1, got {self.nproc_per_node}")
        if self.nproc_per_node is not None and not self.multiprocessing_distributed:
            raise UserError("--nproc-per-node goes with --multiprocessing-distributed")
        if self.evaluate and not (self.resume or self.pretrained):
            raise UserError("--evaluate needs weights: give --resume CKPT or --pretrained")

    def check_batch_divides(self, world_size: int) -> None:
        if self.batch_size % world_size:
            raise UserError(
                f"--batch-size {self.batch_size} is the global batch and must divide evenly over "
                f"{world_size} ranks; use a multiple of {world_size}"
            )

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
