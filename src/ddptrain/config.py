"""The run's configuration: one frozen dataclass, documented field by field, checked where it is
built.

Each field's `help` is the documentation of its flag: cli.py builds the flags of `ddptrain
train` from these fields, so the two cannot drift. config_layers.py merges the layers a Config
is built from (defaults < checkpoint < --config FILE < flags).

Runtime facts (rank, device, per-rank batch) live in `DistEnv`, never here.
"""

import dataclasses
import functools
import math
import urllib.parse
from dataclasses import dataclass, field

from ddptrain.errors import UserError

DEVICES = ("auto", "cpu", "cuda", "mps", "xpu")
BACKENDS = ("gloo", "nccl", "xccl", "mpi", "ucc")
AMP = ("auto", "none", "bf16", "fp16")
STRATEGIES = ("ddp", "fsdp")
# The settings, besides the model, batch and precision, that change what a rank holds: `ddptrain
# plan` takes them as flags, as train does, and traces them as a run sets them.
MEMORY_SETTINGS = ("opt", "momentum", "model_ema", "accum_steps", "reshard_after_forward")
CHECKPOINT_FORMATS = ("full", "sharded")
BAD_IMAGES = ("error", "skip")
# PIL's own default limit (1024 * 1024 * 1024 // 4 // 3): about a 9,500 px square.
MAX_IMAGE_PIXELS = 89_478_485
COMM_HOOKS = ("none", "bf16", "fp16", "powersgd")
# Train crop of the built-in dataset, whose images are 40 px; real data gets ImageNet's 224.
BUILTIN_IMAGE_SIZE = 32
DEFAULT_IMAGE_SIZE = 224
VAL_CROP_RATIO = 0.875  # ImageNet's: val resizes to round(crop / 0.875), then centre-crops


@functools.cache
def architectures() -> tuple[str, ...]:
    """Classification models torchvision builds by name (not helpers such as `get_model`)."""
    import torchvision

    return tuple(torchvision.models.list_models(module=torchvision.models))


def _flag(default, help, *names, metavar=None, choices=None, invocation=False, negatable=False):
    """A field and the documentation of its flag.

    names: the flag's spellings (default: --field-name); help None hides the flag.
    invocation: says where and how one process runs, not what it trains, so it is never taken
    over from a checkpoint or a saved config.json (those describe another invocation).
    negatable: a boolean that also gets --no-NAME, so a flag can undo a config file.
    """
    metadata = dict(
        help=help,
        names=names,
        metavar=metavar,
        choices=choices,
        invocation=invocation,
        negatable=negatable,
    )
    return field(default=default, metadata=metadata)


# The first field of each group of flags in `--help`, and the group's title.
SECTIONS = {
    "arch": "the classic example's flags",
    "out_dir": "ddptrain's own",
    "crop_scale": "augmentation (train and val transforms)",
    "label_smoothing": "loss",
    "opt": "optimizer and learning-rate schedule",
    "model_ema": "exponential moving average of the weights",
    "accum_steps": "the step",
    "progress": "what a run shows and records",
}


@dataclass(frozen=True)
class Config:
    data: str | None = _flag(None, "ImageFolder root with train/ and val/ (default: built-in)")
    arch: str = _flag("resnet18", "torchvision model name", "-a", "--arch")
    workers: int = _flag(4, "data loading workers per rank", "-j", "--workers", invocation=True)
    epochs: int = _flag(90, "total epochs to run")
    start_epoch: int = _flag(0, "manual epoch number (useful on restarts)", invocation=True)
    batch_size: int = _flag(
        256, "GLOBAL batch size, summed over all ranks and nodes", "-b", "--batch-size"
    )
    lr: float = _flag(0.1, "initial learning rate", "--lr", "--learning-rate")
    momentum: float = _flag(0.9, "SGD momentum")
    weight_decay: float = _flag(1e-4, "weight decay", "--wd", "--weight-decay")
    print_freq: int = _flag(10, "progress line every N steps", "-p", "--print-freq")
    resume: str | None = _flag(
        None,
        "checkpoint to resume from; auto: the newest intact one in --out-dir",
        metavar="PATH|auto",
        invocation=True,
    )
    evaluate: bool = _flag(
        False, "evaluate the model on the validation set only", "-e", "--evaluate", invocation=True
    )
    # True: the arch's default torchvision weights; a str: a .safetensors export or checkpoint.
    pretrained: bool | str = _flag(
        False,
        "start from the architecture's default torchvision weights, or from FILE: a "
        ".safetensors export or a ddptrain checkpoint (a head of another class count stays new)",
        metavar="FILE",
    )
    world_size: int = _flag(
        -1, "processes (with --multiprocessing-distributed: nodes)", invocation=True
    )
    rank: int = _flag(
        -1, "process rank (with --multiprocessing-distributed: node rank)", invocation=True
    )
    dist_url: str = _flag(
        "env://", "rendezvous: env:// (torchrun) or tcp://HOST:PORT", invocation=True
    )
    dist_backend: str | None = _flag(
        None, "default: nccl on CUDA, gloo on CPU", choices=BACKENDS, invocation=True
    )
    seed: int | None = _flag(None, "seed everything and use deterministic algorithms")
    gpu: int | None = _flag(None, "use this device index only", invocation=True)
    multiprocessing_distributed: bool = _flag(
        False, "spawn --nproc-per-node processes on this node", invocation=True
    )
    dummy: bool = _flag(False, "use random fake data (throughput tests)")
    no_accel: bool = _flag(
        False, "run on the CPU even when an accelerator is present", invocation=True
    )
    out_dir: str = _flag(
        ".", "where checkpoints, metrics.jsonl and config.json go", invocation=True
    )
    image_size: int | None = _flag(
        None, "train crop in px (default 224; 32 on the built-in dataset)", metavar="PX"
    )
    nproc_per_node: int | None = _flag(
        None,
        "processes for --multiprocessing-distributed (default: accelerator count, 1 on CPU)",
        invocation=True,
    )
    device: str = _flag("auto", "where to run", choices=DEVICES, invocation=True)
    local_rank: int | None = _flag(None, None, "--local-rank", "--local_rank", invocation=True)
    # Well below gloo's 30 minutes, so a stalled rank ends the others instead of the job; long
    # enough for rank 0 to download big weights or save a big checkpoint while others wait.
    dist_timeout: float = _flag(
        600.0,
        "how long a rank waits for the others in a collective before giving up",
        metavar="SECONDS",
        invocation=True,
    )
    checkpoint_every: int = _flag(
        0, "also checkpoint every N optimizer steps, mid-epoch (0: at epoch ends only)", metavar="N"
    )
    # Numbered checkpoints kept, so a damaged newest one has a predecessor.
    keep_last: int = _flag(
        2, "numbered checkpoints to keep in --out-dir (model_best.pt is kept apart)", metavar="K"
    )
    checkpoint_format: str = _flag(
        "full",
        "full: one file, gathered on rank 0; sharded: a folder in which each rank writes its own "
        "shards (for models too big to gather on one host; `ddptrain convert` makes the file)",
        choices=CHECKPOINT_FORMATS,
    )
    # None: the resumed checkpoint's setting, else auto / on for convolutional models / off.
    amp: str | None = _flag(
        None,
        "autocast: auto (default: bf16 where the device has bf16 units, else none), none, "
        "bf16 (CPU and GPU), fp16 (CUDA, GradScaler)",
        choices=AMP,
    )
    channels_last: bool | None = _flag(
        None, "NHWC memory format (default: on for convolutional models)", negatable=True
    )
    compile: bool | None = _flag(None, "torch.compile the model", negatable=True)
    strategy: str = _flag(
        "ddp",
        "ddp: a whole model on every rank; fsdp: parameters, gradients and optimizer state "
        "sharded over the ranks (FSDP2)",
        choices=STRATEGIES,
    )
    fsdp_offload: bool = _flag(
        False, "fsdp: keep parameters, gradients and optimizer state in host memory"
    )
    reshard_after_forward: bool = _flag(
        True,
        "fsdp: free each gathered block but the last after its forward (less memory, one more "
        "all-gather per block)",
        negatable=True,
    )
    ddp_comm_hook: str = _flag(
        "none",
        "ddp: compress gradients before the all-reduce: bf16, fp16, or powersgd (low-rank)",
        choices=COMM_HOOKS,
    )
    powersgd_rank: int = _flag(1, "powersgd: rank of the gradient approximation", metavar="R")
    powersgd_start_step: int = _flag(
        1000,
        "powersgd: plain all-reduce for the first N optimizer steps (at least 2)",
        metavar="N",
    )
    bucket_cap_mb: float | None = _flag(
        None, "ddp: gradient bucket size for the all-reduce (default: torch's 25)", metavar="MB"
    )
    static_graph: bool = _flag(
        False, "ddp: the model uses the same parameters every step (lets DDP skip checks)"
    )

    crop_scale: tuple[float, float] = _flag(
        (0.08, 1.0), "share of the image's area a train crop covers (RandomResizedCrop)"
    )
    crop_ratio: tuple[float, float] = _flag((3 / 4, 4 / 3), "aspect ratios of train crops")
    hflip: float = _flag(
        0.5, "probability of a horizontal flip (0: off; glyphs, text)", metavar="P"
    )
    auto_augment: str = _flag(
        "none",
        "policy: RandAugment, TrivialAugmentWide, AugMix, AutoAugment's ImageNet, none",
        choices=("ra", "ta_wide", "augmix", "imagenet", "none"),
    )
    ra_magnitude: int = _flag(
        9, "RandAugment's magnitude, 0-30 (with --auto-augment ra)", metavar="M"
    )
    random_erase: float = _flag(
        0.0, "probability of erasing a random rectangle to the mean colour (0: off)", metavar="P"
    )
    interpolation: str = _flag(
        "bilinear", "resampling of crops and resizes", choices=("bilinear", "bicubic", "nearest")
    )
    val_resize: int | None = _flag(
        None, "val: resize the short side to this (default: round(val crop / 0.875))", metavar="PX"
    )
    val_crop: int | None = _flag(
        None, "val: centre crop in px (default: --image-size)", metavar="PX"
    )

    label_smoothing: float = _flag(0.0, "cross-entropy label smoothing, in [0, 1)", metavar="EPS")
    mixup_alpha: float = _flag(
        0.0, "mixup of batch pairs, Beta(alpha, alpha) (0: off)", metavar="ALPHA"
    )
    cutmix_alpha: float = _flag(
        0.0,
        "cutmix of batch pairs, Beta(alpha, alpha) (0: off; with mixup: either, 50/50)",
        metavar="ALPHA",
    )

    opt: str = _flag("sgd", "optimizer", choices=("sgd", "sgd-nesterov", "adamw"))
    norm_weight_decay: float | None = _flag(
        None, "weight decay of norm layers and biases (default: --weight-decay)", metavar="WD"
    )
    lr_scheduler: str = _flag(
        "step",
        "LR schedule, stepped at every optimizer step",
        choices=("step", "multistep", "cosine", "none"),
    )
    lr_step_size: int = _flag(30, "step: epochs between LR drops", metavar="EPOCHS")
    lr_gamma: float = _flag(0.1, "step, multistep: LR factor at each drop", metavar="FACTOR")
    lr_milestones: tuple[int, ...] = _flag(
        (), "multistep: epochs at which the LR drops", metavar="EPOCH"
    )
    lr_min: float = _flag(0.0, "cosine: the LR it ends at", metavar="LR")
    lr_warmup_epochs: float = _flag(
        0.0, "epochs of linear warmup before the schedule", metavar="EPOCHS"
    )
    lr_warmup_decay: float = _flag(0.01, "warmup starts at the LR times this", metavar="FACTOR")
    lr_base: float | None = _flag(
        None,
        "instead of --lr: the LR for a global batch of --lr-base-batch, scaled to -b",
        metavar="LR",
    )
    lr_base_batch: int = _flag(256, "the global batch --lr-base is given for", metavar="B")

    model_ema: bool = _flag(False, "evaluate and keep an EMA of the weights", negatable=True)
    model_ema_decay: float = _flag(
        0.9999,
        "EMA decay per optimizer step (of the global batch: any world size)",
        metavar="DECAY",
    )
    model_ema_steps: int = _flag(
        32, "update the EMA every N optimizer steps (decay^N each time)", metavar="N"
    )

    accum_steps: int = _flag(
        1,
        "micro-batches per optimizer step: each rank's share of -b is split into this many, "
        "with the gradient all-reduced once, after the last",
        metavar="K",
    )
    clip_grad_norm: float | None = _flag(
        None, "clip the gradients' total norm (over all ranks) to this", metavar="NORM"
    )

    verify_images: bool = _flag(
        False, "decode every image of DATA before training (as `ddptrain check`)"
    )
    bad_images: str = _flag(
        "error",
        "an undecodable image: stop, or leave it out on every rank (checks every image first)",
        choices=BAD_IMAGES,
    )
    max_image_pixels: int = _flag(
        MAX_IMAGE_PIXELS,
        "an image whose header declares more pixels is bad (a decompression bomb)",
        metavar="N",
    )
    nonfinite: str = _flag(
        "error",
        "a non-finite loss or gradient: error stops every rank naming the step and the last "
        "good checkpoint; skip drops that step's update on every rank (a host sync per step)",
        choices=("error", "skip"),
    )
    max_skipped: int = _flag(
        10, "--nonfinite skip: stop once this many steps were skipped in a run", metavar="N"
    )

    progress: str = _flag(
        "auto",
        "rank 0's view of training: a bar on a terminal, plain lines elsewhere (auto), or none",
        choices=("auto", "bar", "lines", "none"),
        invocation=True,
    )
    tensorboard: bool = _flag(
        False, "also write TensorBoard event files to OUT_DIR/tensorboard", invocation=True
    )
    profile: int = _flag(
        0,
        "rank 0 writes a torch.profiler trace of this many training steps, after one warm-up "
        "step, to OUT_DIR/profile.json (chrome://tracing, Perfetto)",
        metavar="STEPS",
        invocation=True,
    )

    # Not settings: the fields a config file or a flag gave, which a checkpoint's settings
    # must not replace on resume (config_layers.resumed), and those the command line gave,
    # which the run warns of where they act on nothing (inert_flags).
    given: frozenset = field(default=frozenset(), compare=False, repr=False)
    on_command_line: frozenset = field(default=frozenset(), compare=False, repr=False)
    # True while the settings of the checkpoint --resume names are still to come in under these
    # (cli.parse); `settled` ends the wait.
    checkpoint_pending: bool = field(default=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.image_size is None:
            builtin = self.data is None and not self.dummy
            size = BUILTIN_IMAGE_SIZE if builtin else DEFAULT_IMAGE_SIZE
            object.__setattr__(self, "image_size", size)
        if isinstance(self.resume, str) and not self.resume.strip():
            # None, as the classic example's `if args.resume:` reads it: a script passing
            # --resume "$CKPT" with CKPT unset starts fresh.
            object.__setattr__(self, "resume", None)
        self._check()
        self._check_recipe()
        if not self.checkpoint_pending:
            self._check_combinations()
        self._check_arch()

    def _check(self) -> None:
        for f in dataclasses.fields(self):  # argparse's float() and TOML take nan and inf
            value = getattr(self, f.name)
            for number in value if isinstance(value, tuple) else (value,):
                if isinstance(number, float) and not math.isfinite(number):
                    raise UserError(f"{flag_name(f.name)} must be a finite number, got {number}")
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
            "--profile": (self.profile, 0),
            "--max-image-pixels": (self.max_image_pixels, 1),
        }
        for flag, (value, low) in at_least.items():
            if value < low:
                raise UserError(f"{flag} must be at least {low}, got {value}")
        # numpy's seed sequences take no negative seed, torch's generator none of 2**64 or more
        # (and each rank seeds with seed + rank).
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise UserError(f"--seed must be from 0 to 2**63 - 1, got {self.seed}")
        for flag, value in (("--lr", self.lr), ("--momentum", self.momentum)):
            if value < 0:
                raise UserError(f"{flag} must not be negative, got {value}")
        if self.weight_decay < 0:
            raise UserError(f"--weight-decay must not be negative, got {self.weight_decay}")
        for f in dataclasses.fields(self):
            choices, value = f.metadata.get("choices"), getattr(self, f.name)
            if choices and value is not None and value not in choices:
                raise UserError(
                    f"{flag_name(f.name)} must be one of {', '.join(choices)}, got {value!r}"
                )
        if self.no_accel and self.device not in ("auto", "cpu"):
            raise UserError(f"--no-accel contradicts --device {self.device}")
        if self.gpu is not None and (self.gpu < 0 or self.no_accel or self.device == "cpu"):
            raise UserError(f"--gpu {self.gpu} needs an accelerator device and an index >= 0")
        if not self.dist_url.startswith(("env://", "tcp://", "file://")):
            raise UserError(
                f"--dist-url must start with env://, tcp:// or file://: {self.dist_url}"
            )
        if self.dist_url.startswith("tcp://") and not _host_and_port(self.dist_url):
            raise UserError(f"--dist-url {self.dist_url}: give tcp://HOST:PORT, PORT a number")
        if self.world_size == 0 or self.world_size < -1:
            raise UserError(f"--world-size must be at least 1, got {self.world_size}")
        if self.world_size > 0 and self.rank >= self.world_size:
            raise UserError(f"--rank {self.rank} must be below --world-size {self.world_size}")
        if self.nproc_per_node is not None and self.nproc_per_node < 1:
            raise UserError(f"--nproc-per-node must be at least 1, got {self.nproc_per_node}")
        if self.nproc_per_node is not None and not self.multiprocessing_distributed:
            raise UserError("--nproc-per-node goes with --multiprocessing-distributed")
        if isinstance(self.pretrained, str) and not self.pretrained.strip():
            raise UserError("--pretrained FILE: the path is empty")
        for flag, path in (("--out-dir", self.out_dir), ("DATA", self.data)):
            if path is not None and not path.strip():  # else the current directory, unsaid
                raise UserError(f"{flag}: the path is empty")
        if self.bucket_cap_mb is not None and self.bucket_cap_mb <= 0:
            raise UserError(f"--bucket-cap-mb must be positive, got {self.bucket_cap_mb}")
        if self.powersgd_rank < 1 or self.powersgd_start_step < 2:
            raise UserError("--powersgd-rank must be at least 1 and --powersgd-start-step 2")
        if self.clip_grad_norm is not None and self.clip_grad_norm <= 0:
            raise UserError(f"--clip-grad-norm must be positive, got {self.clip_grad_norm}")
        if self.evaluate and not (self.resume or self.pretrained):
            raise UserError("--evaluate needs weights: give --resume CKPT or --pretrained")

    def _check_arch(self) -> None:
        """Last: torchvision's list takes seconds to import, which a mistake found without it
        need not wait for."""
        if self.arch not in architectures():
            raise UserError(
                f"--arch: unknown architecture {self.arch!r}; choose one of: "
                + ", ".join(architectures())
            )

    def _check_recipe(self) -> None:
        """The augmentation, loss, optimizer, schedule and EMA settings."""
        low, high = self.crop_scale
        if not 0 < low <= high <= 1:
            raise UserError(f"--crop-scale MIN MAX needs 0 < MIN <= MAX <= 1, got {low} {high}")
        low, high = self.crop_ratio
        if not 0 < low <= high:
            raise UserError(f"--crop-ratio MIN MAX needs 0 < MIN <= MAX, got {low} {high}")
        within = {
            "--hflip": (self.hflip, 0, 1),
            "--random-erase": (self.random_erase, 0, 1),
            "--ra-magnitude": (self.ra_magnitude, 0, 30),
            "--lr-warmup-decay": (self.lr_warmup_decay, 1e-12, 1),
            "--model-ema-decay": (self.model_ema_decay, 0, 1),
        }
        for flag, (value, low, high) in within.items():
            if not low <= value <= high:
                raise UserError(f"{flag} must be between {low:g} and {high:g}, got {value}")
        if not 0 <= self.label_smoothing < 1:
            raise UserError(f"--label-smoothing must be in [0, 1), got {self.label_smoothing}")
        not_negative = {
            "--mixup-alpha": self.mixup_alpha,
            "--cutmix-alpha": self.cutmix_alpha,
            "--norm-weight-decay": self.norm_weight_decay or 0.0,
            "--lr-min": self.lr_min,
            "--lr-warmup-epochs": self.lr_warmup_epochs,
        }
        for flag, value in not_negative.items():
            if value < 0:
                raise UserError(f"{flag} must not be negative, got {value}")
        positive = {
            "--lr-step-size": self.lr_step_size,
            "--lr-gamma": self.lr_gamma,
            "--lr-base": 1 if self.lr_base is None else self.lr_base,
            "--lr-base-batch": self.lr_base_batch,
            "--model-ema-steps": self.model_ema_steps,
            "--accum-steps": self.accum_steps,
            "--max-skipped": self.max_skipped,
        }
        for flag, value in positive.items():
            if value <= 0:
                raise UserError(f"{flag} must be positive, got {value}")
        milestones = self.lr_milestones
        if any(m < 1 for m in milestones) or list(milestones) != sorted(set(milestones)):
            raise UserError(f"--lr-milestones must rise and be >= 1, got {list(milestones)}")

    def _check_combinations(self) -> None:
        """The settings that must agree with each other. They wait while a checkpoint's
        settings may still come in under the flags (`checkpoint_pending`): `--fsdp-offload`
        resuming an fsdp run, `--val-resize` evaluating a 16 px one."""
        if self.strategy != "fsdp" and (self.fsdp_offload or not self.reshard_after_forward):
            flag = "--fsdp-offload" if self.fsdp_offload else "--no-reshard-after-forward"
            raise UserError(f"{flag} goes with --strategy fsdp")
        ddp_only = {
            "--ddp-comm-hook": self.ddp_comm_hook != "none",
            "--bucket-cap-mb": self.bucket_cap_mb is not None,
            "--static-graph": self.static_graph,
        }
        for flag, given in ddp_only.items():
            if given and self.strategy == "fsdp":
                raise UserError(f"{flag} goes with --strategy ddp (fsdp has no DDP reducer)")
        if self.ddp_comm_hook == "powersgd" and self.static_graph:
            raise UserError(
                "--ddp-comm-hook powersgd with --static-graph: a static graph lets DDP rebuild "
                "its buckets, which would make a resumed run differ; drop --static-graph"
            )
        if self.ddp_comm_hook == "powersgd" and self.amp == "fp16":
            raise UserError(
                "--ddp-comm-hook powersgd with --amp fp16: the gradient scaler's overflowing "
                "steps would feed inf into PowerSGD's error feedback, which keeps it for every "
                "later step; use --amp bf16 or another hook"
            )
        crop = self.eval_crop
        if crop < 16 or (self.val_resize is not None and self.val_resize < crop):
            raise UserError(
                f"--val-crop must be at least 16 and --val-resize at least the crop; got crop "
                f"{crop}, resize {self.val_resize}"
            )
        if self.opt == "sgd-nesterov" and self.momentum <= 0:
            raise UserError("--opt sgd-nesterov needs --momentum above 0")
        if self.lr_scheduler == "multistep" and not self.lr_milestones:
            raise UserError("--lr-scheduler multistep needs --lr-milestones EPOCH [EPOCH ...]")
        if self.lr_scheduler == "cosine" and 0 < self.epochs <= self.lr_warmup_epochs:
            raise UserError(
                f"--lr-warmup-epochs {self.lr_warmup_epochs:g} leaves no epochs of --epochs "
                f"{self.epochs} for the cosine schedule"
            )

    @property
    def checks_images(self) -> bool:
        """Every image of DATA is decoded before training (data/check.py)."""
        return self.verify_images or self.bad_images == "skip"

    @property
    def eval_crop(self) -> int:
        """The centre crop of evaluation: --val-crop, else the train crop."""
        return self.image_size if self.val_crop is None else self.val_crop

    def settled(self) -> "Config":
        """This config once no checkpoint's settings are still to come in (they are in, or
        there are none): the checks that waited for them run now."""
        if not self.checkpoint_pending:
            return self
        return dataclasses.replace(self, checkpoint_pending=False)

    def check_batch_divides(self, world_size: int) -> None:
        if self.batch_size % world_size:
            raise UserError(
                f"--batch-size {self.batch_size} is the global batch and must divide evenly over "
                f"{world_size} ranks; use a multiple of {world_size}"
            )
        per_rank = self.batch_size // world_size
        if per_rank % self.accum_steps:
            raise UserError(
                f"--accum-steps {self.accum_steps} must divide each rank's share of -b "
                f"{self.batch_size} ({per_rank} on {world_size} rank(s))"
            )

    def check_batch_divides_early(self, world_size: int) -> None:
        """check_batch_divides before anything slow (--verify-images decodes every image), when
        no checkpoint can bring its own -b or --accum-steps: those are checked once merged."""
        if self.resume is None or {"batch_size", "accum_steps"} <= self.given:
            self.check_batch_divides(world_size)

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in settings()}


def settings() -> tuple[dataclasses.Field, ...]:
    """The fields that are settings (all but `given`, `on_command_line` and
    `checkpoint_pending`)."""
    layers = ("given", "on_command_line", "checkpoint_pending")
    return tuple(f for f in dataclasses.fields(Config) if f.name not in layers)


# Settings that act only under another: (whether they act in a config, what they need). The
# classic example took them in silence: `--opt adamw --momentum 0.5` trained without a word
# that AdamW has no momentum, and `--lr-min` under the step schedule changed nothing.
_ACTS_ONLY_WITH = {
    "momentum": (lambda c: c.opt != "adamw", "--opt sgd or sgd-nesterov"),
    "lr_step_size": (lambda c: c.lr_scheduler == "step", "--lr-scheduler step"),
    "lr_gamma": (
        lambda c: c.lr_scheduler in ("step", "multistep"),
        "--lr-scheduler step or multistep",
    ),
    "lr_milestones": (lambda c: c.lr_scheduler == "multistep", "--lr-scheduler multistep"),
    "lr_min": (lambda c: c.lr_scheduler == "cosine", "--lr-scheduler cosine"),
    "lr_warmup_decay": (lambda c: c.lr_warmup_epochs > 0, "--lr-warmup-epochs above 0"),
    "lr_base_batch": (lambda c: c.lr_base is not None, "--lr-base"),
    "ra_magnitude": (lambda c: c.auto_augment == "ra", "--auto-augment ra"),
    "model_ema_decay": (lambda c: c.model_ema, "--model-ema"),
    "model_ema_steps": (lambda c: c.model_ema, "--model-ema"),
    "powersgd_rank": (lambda c: c.ddp_comm_hook == "powersgd", "--ddp-comm-hook powersgd"),
    "powersgd_start_step": (lambda c: c.ddp_comm_hook == "powersgd", "--ddp-comm-hook powersgd"),
    "max_skipped": (lambda c: c.nonfinite == "skip", "--nonfinite skip"),
}


def inert_flags(config: Config) -> list[str]:
    """A line for each flag given on the command line that acts on nothing in this run, its
    settings merged (a resumed checkpoint's included). Flags, not config files: a file (a
    recipe, a run's config.json) sets many that a flag on top may leave idle."""
    return [
        f"{flag_name(name)} does nothing in this run: it acts only with {needs}"
        for name, (acts, needs) in _ACTS_ONLY_WITH.items()
        if name in config.on_command_line and not acts(config)
    ]


def flag_name(name: str) -> str:
    """The long flag of a field: `weight_decay` -> `--weight-decay`."""
    return "--" + name.replace("_", "-")


def _host_and_port(url: str) -> bool:
    parsed = urllib.parse.urlparse(url)
    try:
        return bool(parsed.hostname) and parsed.port is not None
    except ValueError:  # a port that is not a number, or out of range
        return False
