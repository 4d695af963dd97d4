"""The run's settings, in sections, each read by the modules of its concern:

    data        DataSettings        DATA, loading, the train and val transforms, image checks
    model       ModelSettings       the architecture, its starting weights, precision, compile
    optim       OptimSettings       epochs, batch, optimizer, LR schedule, loss, EMA, the step,
                                    the seed
    parallel    ParallelSettings    the strategy (ddp, fsdp) and how it communicates
    checkpoint  CheckpointSettings  --out-dir, resuming and evaluating, saving
    launch      LaunchSettings      where and how each process runs: ranks, rendezvous, device
    report      ReportSettings      what rank 0 shows and records

Each setting is declared once, with the documentation of its flag (`_flag`): cli.py builds the
flags of `ddptrain train` from them, so the two cannot drift. A setting's flat key, its long
flag's name with underscores, is also its key in a config file and in config.json:
`Config(lr=0.1, data="x")` builds from flat keys, `to_dict` gives them back, and HELP_GROUPS
keeps the flags in the order `--help` has always shown. Each section checks its own settings;
Config checks those of different sections against each other. config_layers.py merges the
layers a Config is built from (defaults < checkpoint < --config FILE < flags) and keeps what
each layer gave.

Runtime facts (rank, device, per-rank batch) live in `DistEnv`, never here.
"""

import dataclasses
import functools
import math
import re
import urllib.parse
from dataclasses import dataclass, field
from typing import ClassVar

from ddptrain.errors import UserError

DEVICES = ("auto", "cpu", "cuda", "mps", "xpu")
BACKENDS = ("gloo", "nccl", "xccl", "mpi", "ucc")
AMP = ("auto", "none", "bf16", "fp16")
STRATEGIES = ("ddp", "fsdp")
# The settings, besides the model, batch and precision, that change what a rank holds: `ddptrain
# plan` takes them as flags, as train does, and traces them as a run sets them. Its
# freeze_backbone is a backbone frozen for the whole run: a run with --unfreeze-epoch is planned
# unfrozen, its larger part (run.py).
MEMORY_SETTINGS = (
    "opt", "momentum", "model_ema", "accum_steps", "reshard_after_forward", "freeze_backbone",
    "grad_checkpointing",
)  # fmt: skip
CHECKPOINT_FORMATS = ("full", "sharded")
BAD_IMAGES = ("error", "skip")
DECODE_DEVICES = ("cpu", "cuda")
# PIL's own default limit (1024 * 1024 * 1024 // 4 // 3): about a 9,500 px square.
MAX_IMAGE_PIXELS = 89_478_485
# `ddptrain pack`: shards of about 256 MB (WebDataset's advice: 100 MB to 1 GB); the JPEG
# quality of images --max-side shrinks.
PACK_SHARD_MB, PACK_QUALITY = 256, 90
COMM_HOOKS = ("none", "bf16", "fp16", "powersgd")
# Train crop of the built-in dataset, whose images are 40 px; real data gets ImageNet's 224.
BUILTIN_IMAGE_SIZE = 32
DEFAULT_IMAGE_SIZE = 224
VAL_CROP_RATIO = 0.875  # ImageNet's: val resizes to round(crop / 0.875), then centre-crops


TIMM_PREFIX = "timm:"  # --arch timm:NAME[.TAG]: one of timm's models (model/providers.py)


def _check_timm_arch(arch: str) -> None:
    """timm:NAME names one of timm's models, and timm:NAME.TAG one of its published weights."""
    import timm

    name = arch.removeprefix(TIMM_PREFIX)
    base, _, tag = name.partition(".")
    if not timm.is_model(base):
        like = timm.list_models(f"*{base[:4]}*")[:10] if base else []
        hint = f"; similar: {', '.join(like)}" if like else ""
        raise UserError(
            f"--arch {arch}: timm has no model {base!r} (timm.list_models() lists them){hint}"
        )
    if tag and name not in timm.list_pretrained(base):
        tags = [t.partition(".")[2] for t in timm.list_pretrained(base)]
        raise UserError(
            f"--arch {arch}: timm has no weights tagged {tag!r} for {base}; its tags: "
            + (", ".join(tags) or "none")
        )


@functools.cache
def architectures() -> tuple[str, ...]:
    """Classification models torchvision builds by name (not helpers such as `get_model`)."""
    import torchvision

    return tuple(torchvision.models.list_models(module=torchvision.models))


def _flag(
    default, help, *names, metavar=None, choices=None, invocation=False, negatable=False, key=None
):
    """A setting and the documentation of its flag.

    names: the flag's spellings (default: --flat-key); help None hides the flag.
    invocation: says where and how one process runs, not what it trains, so it is never taken
    over from a checkpoint or a saved config.json (those describe another invocation).
    negatable: a boolean that also gets --no-NAME, so a flag can undo a config file.
    key: the flat key, where the field's name differs from it (DATA's `root`).
    """
    metadata = dict(
        help=help,
        names=names,
        metavar=metavar,
        choices=choices,
        invocation=invocation,
        negatable=negatable,
        key=key,
    )
    return field(default=default, metadata=metadata)


def flat_key(f: dataclasses.Field) -> str:
    """A setting's key in Config(), a config file and config.json."""
    return f.metadata["key"] or f.name


# The groups of flags in `--help` (and docs/flags.md), each flag in its place: the order users
# have always seen, which the sections need not keep. DATA, the positional, comes first.
HELP_GROUPS = {
    "the classic example's flags": (
        "arch", "workers", "epochs", "start_epoch", "batch_size", "lr", "momentum",
        "weight_decay", "print_freq", "resume", "evaluate", "pretrained", "world_size", "rank",
        "dist_url", "dist_backend", "seed", "gpu", "multiprocessing_distributed", "dummy",
        "no_accel",
    ),
    "ddptrain's own": (
        "out_dir", "image_size", "image_column", "label_column", "cache_dir", "cache_size",
        "decode_device",
        "nproc_per_node", "device",
        "local_rank", "dist_timeout", "checkpoint_every", "keep_last", "checkpoint_format", "amp",
        "channels_last", "compile", "strategy", "fsdp_offload", "reshard_after_forward",
        "ddp_comm_hook", "powersgd_rank", "powersgd_start_step", "bucket_cap_mb", "static_graph",
        "early_stop",
    ),
    "augmentation (train and val transforms)": (
        "crop_scale", "crop_ratio", "hflip", "auto_augment", "ra_magnitude", "random_erase",
        "interpolation", "val_resize", "val_crop", "mean", "std",
    ),
    "loss": ("label_smoothing", "mixup_alpha", "cutmix_alpha"),
    "optimizer and learning-rate schedule": (
        "opt", "norm_weight_decay", "lr_scheduler", "lr_step_size", "lr_gamma", "lr_milestones",
        "lr_min", "lr_warmup_epochs", "lr_warmup_decay", "lr_base", "lr_base_batch",
    ),
    "exponential moving average of the weights": (
        "model_ema", "model_ema_decay", "model_ema_steps",
    ),
    "the step": (
        "accum_steps", "clip_grad_norm", "verify_images", "bad_images", "max_image_pixels",
        "nonfinite", "max_skipped",
    ),
    "what a run shows and records": ("progress", "tensorboard", "log_to", "profile"),
    "fine-tuning": (
        "freeze_backbone", "unfreeze_epoch", "layer_decay", "head_lr_scale", "drop_path",
        "grad_checkpointing",
    ),
}  # fmt: skip


def _check_values(section) -> None:
    """The checks every section makes of its own settings: numbers are finite (argparse's
    float() and TOML take nan and inf), and a setting with choices holds one of them."""
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        for number in value if isinstance(value, tuple) else (value,):
            if isinstance(number, float) and not math.isfinite(number):
                raise UserError(f"{flag_name(flat_key(f))} must be a finite number, got {number}")
        choices = f.metadata["choices"]
        for item in value if isinstance(value, tuple) else (value,):
            if choices and item is not None and item not in choices:
                raise UserError(
                    f"{flag_name(flat_key(f))} must be one of {', '.join(choices)}, got {item!r}"
                )


def _at_least(checks: dict) -> None:
    for flag, (value, low) in checks.items():
        if value < low:
            raise UserError(f"{flag} must be at least {low}, got {value}")


def _within(checks: dict) -> None:
    for flag, (value, low, high) in checks.items():
        if not low <= value <= high:
            raise UserError(f"{flag} must be between {low:g} and {high:g}, got {value}")


def _not_negative(checks: dict) -> None:
    for flag, value in checks.items():
        if value < 0:
            raise UserError(f"{flag} must not be negative, got {value}")


def _positive(checks: dict) -> None:
    for flag, value in checks.items():
        if value <= 0:
            raise UserError(f"{flag} must be positive, got {value}")


def _not_empty(flag: str, path: str | None) -> None:
    if path is not None and not path.strip():  # else the current directory, unsaid
        raise UserError(f"{flag}: the path is empty")


# Where credentials go instead of a URL: what the 401/403 lines and the refusal below say.
CREDENTIALS_ADVICE = (
    "give them as the backend reads them (~/.netrc for HTTP(S); the environment, such as "
    "AWS_ACCESS_KEY_ID for s3://): docs/data.md"
)


# A URL's authority (from `scheme://` to the next /, ? or #) holding an "@": a user name or
# password, wherever it stands in an fsspec chain (`simplecache::https://...`), and whatever it
# holds ("::" included, which a split into the chain's links would cut).
_USERINFO = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://)[^/?#]*@")


def check_no_credentials(url: str | None, what: str) -> None:
    """Refuses a URL that holds a user name or password, in any link of an fsspec chain:
    DATA is recorded to resume the run (config.json, every checkpoint, trackers), and named in
    error lines. The URL is shown with them masked."""
    if url is None or not _USERINFO.search(url):
        return
    masked = _USERINFO.sub(r"\1***@", url)
    raise UserError(
        f"{what} {masked} holds a user name or password, which would be recorded with the "
        f"run's settings: leave them out of the URL and {CREDENTIALS_ADVICE}"
    )


@dataclass(frozen=True)
class DataSettings:
    """DATA, how it is loaded, the train and val transforms, and the checks of its images."""

    root: str | None = _flag(
        None,
        "ImageFolder root with train/ and val/, a packed set (`ddptrain pack`), or a table set "
        "(default: built-in)",
        key="data",
    )
    image_column: str = _flag("image", "a table set's column of encoded images", metavar="NAME")
    label_column: str = _flag("label", "a table set's column of class labels", metavar="NAME")
    cache_dir: str | None = _flag(
        None,
        "a packed set at a URL: where shards a server sends only whole are kept, shared by the "
        "node's ranks (default: ~/.cache/ddptrain/shards)",
        metavar="DIR",
        invocation=True,
    )
    cache_size: float = _flag(
        10.0,
        "the most that folder holds, in GiB (least recently used go first)",
        metavar="GIB",
        invocation=True,
    )
    workers: int = _flag(4, "data loading workers per rank", "-j", "--workers", invocation=True)
    decode_device: str = _flag(
        "cpu",
        "where JPEGs are decoded and transformed: in the loader workers (cpu), or in the "
        "training process on the GPU (cuda: nvJPEG; the workers only read bytes)",
        choices=DECODE_DEVICES,
        invocation=True,
    )
    dummy: bool = _flag(False, "use random fake data (throughput tests)")
    image_size: int | None = _flag(
        None, "train crop in px (default 224; 32 on the built-in dataset)", metavar="PX"
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
    mean: tuple[float, float, float] | None = _flag(
        None,
        "per-channel mean the inputs, in [0, 1], are normalised by (default: ImageNet's; "
        "with --pretrained, that of the weights)",
        metavar=("R", "G", "B"),
    )
    std: tuple[float, float, float] | None = _flag(
        None,
        "per-channel standard deviation they are divided by (default: as --mean)",
        metavar=("R", "G", "B"),
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

    def __post_init__(self) -> None:
        if self.image_size is None:
            builtin = self.root is None and not self.dummy
            size = BUILTIN_IMAGE_SIZE if builtin else DEFAULT_IMAGE_SIZE
            object.__setattr__(self, "image_size", size)
        _check_values(self)
        _at_least(
            {
                "--workers": (self.workers, 0),
                "--image-size": (self.image_size, 16),
                "--max-image-pixels": (self.max_image_pixels, 1),
                "--cache-size": (self.cache_size, 0),
            }
        )
        _not_empty("DATA", self.root)
        check_no_credentials(self.root, "DATA")
        columns = (self.image_column, self.label_column)
        if not all(columns) or self.image_column == self.label_column:
            raise UserError(
                f"--image-column {self.image_column!r} and --label-column "
                f"{self.label_column!r} must name two different columns"
            )
        low, high = self.crop_scale
        if not 0 < low <= high <= 1:
            raise UserError(f"--crop-scale MIN MAX needs 0 < MIN <= MAX <= 1, got {low} {high}")
        if self.std is not None and min(self.std) <= 0:
            raise UserError(f"--std must be positive in every channel, got {self.std}")
        low, high = self.crop_ratio
        if not 0 < low <= high:
            raise UserError(f"--crop-ratio MIN MAX needs 0 < MIN <= MAX, got {low} {high}")
        _within(
            {
                "--hflip": (self.hflip, 0, 1),
                "--random-erase": (self.random_erase, 0, 1),
                "--ra-magnitude": (self.ra_magnitude, 0, 30),
            }
        )

    def check_combinations(self) -> None:
        crop = self.eval_crop
        if crop < 16 or (self.val_resize is not None and self.val_resize < crop):
            raise UserError(
                f"--val-crop must be at least 16 and --val-resize at least the crop; got crop "
                f"{crop}, resize {self.val_resize}"
            )

    @property
    def checks_images(self) -> bool:
        """Every image of DATA is decoded before training (data/check.py)."""
        return self.verify_images or self.bad_images == "skip"

    @property
    def eval_crop(self) -> int:
        """The centre crop of evaluation: --val-crop, else the train crop."""
        return self.image_size if self.val_crop is None else self.val_crop


@dataclass(frozen=True)
class ModelSettings:
    """The architecture, the weights it starts from, and how its math runs (model/precision.py).
    Config checks --arch last (check_arch)."""

    arch: str = _flag(
        "resnet18", "torchvision model name, or timm:NAME[.TAG] for timm's", "-a", "--arch"
    )
    # True: the arch's default (or tagged) published weights; a str: a .safetensors file or a
    # checkpoint.
    pretrained: bool | str = _flag(
        False,
        "start from the architecture's default published weights (timm's: from the Hugging Face "
        "cache, with their preprocessing), or from FILE: a .safetensors export, a ddptrain "
        "checkpoint or timm's model.safetensors (a head of another class count stays new)",
        metavar="FILE",
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
    # 0: the model's own (torchvision builds convnext, swin, efficientnet and maxvit with some).
    drop_path: float = _flag(
        0.0,
        "stochastic depth: the rate at which residual blocks are dropped in training, for "
        "models that have it (0: the model's own)",
        metavar="P",
    )
    grad_checkpointing: bool = _flag(
        False,
        "recompute each block's activations in backward instead of keeping them (less memory "
        "for a larger model or batch, one more forward of each block)",
    )

    def __post_init__(self) -> None:
        _check_values(self)
        if isinstance(self.pretrained, str) and not self.pretrained.strip():
            raise UserError("--pretrained FILE: the path is empty")
        if not 0 <= self.drop_path < 1:
            raise UserError(f"--drop-path must be in [0, 1), got {self.drop_path}")

    def check_arch(self) -> None:
        """Apart, and last in Config: torchvision's list takes seconds to import, which a
        mistake found without it need not wait for."""
        if self.arch.startswith(TIMM_PREFIX):
            _check_timm_arch(self.arch)
        elif self.arch not in architectures():
            raise UserError(
                f"--arch: unknown architecture {self.arch!r}; choose one of: "
                + ", ".join(architectures())
            )


@dataclass(frozen=True)
class OptimSettings:
    """How the model is trained: epochs and batch, the optimizer and its LR schedule, the loss,
    the EMA of the weights, the step (accumulation, clipping, non-finite values), the seed."""

    epochs: int = _flag(90, "total epochs to run")
    batch_size: int = _flag(
        256, "GLOBAL batch size, summed over all ranks and nodes", "-b", "--batch-size"
    )
    lr: float = _flag(0.1, "initial learning rate", "--lr", "--learning-rate")
    momentum: float = _flag(0.9, "SGD momentum")
    weight_decay: float = _flag(1e-4, "weight decay", "--wd", "--weight-decay")
    seed: int | None = _flag(None, "seed everything and use deterministic algorithms")

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
    nonfinite: str = _flag(
        "error",
        "a non-finite loss or gradient: error stops every rank naming the step and the last "
        "good checkpoint; skip drops that step's update on every rank (a host sync per step)",
        choices=("error", "skip"),
    )
    max_skipped: int = _flag(
        10, "--nonfinite skip: stop once this many steps were skipped in a run", metavar="N"
    )
    early_stop: int = _flag(
        0,
        "stop once the val top-1 that picks model_best.pt (the model's or the EMA's) has not "
        "improved for this many epochs in a row (0: never)",
        metavar="PATIENCE",
    )

    freeze_backbone: bool = _flag(
        False,
        "train the classifier head only: the rest keeps its weights, gets no gradients and no "
        "optimizer state, and its BatchNorm layers stay in eval mode",
    )
    unfreeze_epoch: int | None = _flag(
        None,
        "--freeze-backbone for the first N epochs only, then train the whole model",
        metavar="N",
    )
    layer_decay: float | None = _flag(
        None,
        "each layer's LR is FACTOR times the LR of the layer above it, the top one's the LR "
        "(layers: timm's grouping for timm models; stem, each block, head for torchvision's)",
        metavar="FACTOR",
    )
    head_lr_scale: float = _flag(
        1.0, "the classifier head's LR is the LR times this (a new head learns faster)", metavar="X"
    )

    def __post_init__(self) -> None:
        _check_values(self)
        _at_least(
            {
                "--epochs": (self.epochs, 0),
                "--batch-size": (self.batch_size, 1),
                "--early-stop": (self.early_stop, 0),
            }
        )
        # numpy's seed sequences take no negative seed, torch's generator none of 2**64 or more
        # (and each rank seeds with seed + rank).
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise UserError(f"--seed must be from 0 to 2**63 - 1, got {self.seed}")
        _not_negative(
            {"--lr": self.lr, "--momentum": self.momentum, "--weight-decay": self.weight_decay}
        )
        if self.clip_grad_norm is not None:
            _positive({"--clip-grad-norm": self.clip_grad_norm})
        _within(
            {
                "--lr-warmup-decay": (self.lr_warmup_decay, 1e-12, 1),
                "--model-ema-decay": (self.model_ema_decay, 0, 1),
            }
        )
        if not 0 <= self.label_smoothing < 1:
            raise UserError(f"--label-smoothing must be in [0, 1), got {self.label_smoothing}")
        _not_negative(
            {
                "--mixup-alpha": self.mixup_alpha,
                "--cutmix-alpha": self.cutmix_alpha,
                "--norm-weight-decay": self.norm_weight_decay or 0.0,
                "--lr-min": self.lr_min,
                "--lr-warmup-epochs": self.lr_warmup_epochs,
            }
        )
        _positive(
            {
                "--lr-step-size": self.lr_step_size,
                "--lr-gamma": self.lr_gamma,
                "--lr-base": 1 if self.lr_base is None else self.lr_base,
                "--lr-base-batch": self.lr_base_batch,
                "--model-ema-steps": self.model_ema_steps,
                "--accum-steps": self.accum_steps,
                "--max-skipped": self.max_skipped,
            }
        )
        if self.layer_decay is not None:
            _within({"--layer-decay": (self.layer_decay, 1e-12, 1)})
        _positive({"--head-lr-scale": self.head_lr_scale})
        if self.unfreeze_epoch is not None:
            _at_least({"--unfreeze-epoch": (self.unfreeze_epoch, 1)})
        milestones = self.lr_milestones
        if any(m < 1 for m in milestones) or list(milestones) != sorted(set(milestones)):
            raise UserError(f"--lr-milestones must rise and be >= 1, got {list(milestones)}")

    def check_combinations(self) -> None:
        if self.unfreeze_epoch is not None and not self.freeze_backbone:
            raise UserError(
                f"--unfreeze-epoch {self.unfreeze_epoch} needs --freeze-backbone: it says when "
                "the frozen backbone starts to train"
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


@dataclass(frozen=True)
class ParallelSettings:
    """How the model is spread over the ranks (parallel/parallelize.py, fsdp.py, comm_hooks.py)."""

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

    def __post_init__(self) -> None:
        _check_values(self)
        if self.bucket_cap_mb is not None:
            _positive({"--bucket-cap-mb": self.bucket_cap_mb})
        if self.powersgd_rank < 1 or self.powersgd_start_step < 2:
            raise UserError("--powersgd-rank must be at least 1 and --powersgd-start-step 2")

    def check_combinations(self) -> None:
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


@dataclass(frozen=True)
class CheckpointSettings:
    """Where the run's files go, what it resumes or evaluates, and how it saves (state/)."""

    out_dir: str = _flag(
        ".", "where checkpoints, metrics.jsonl and config.json go", invocation=True
    )
    resume: str | None = _flag(
        None,
        "checkpoint to resume from; auto: the newest intact one in --out-dir",
        metavar="PATH|auto",
        invocation=True,
    )
    start_epoch: int = _flag(0, "manual epoch number (useful on restarts)", invocation=True)
    evaluate: bool = _flag(
        False, "evaluate the model on the validation set only", "-e", "--evaluate", invocation=True
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

    def __post_init__(self) -> None:
        if isinstance(self.resume, str) and not self.resume.strip():
            # None, as the classic example's `if args.resume:` reads it: a script passing
            # --resume "$CKPT" with CKPT unset starts fresh.
            object.__setattr__(self, "resume", None)
        _check_values(self)
        _at_least(
            {
                "--start-epoch": (self.start_epoch, 0),
                "--checkpoint-every": (self.checkpoint_every, 0),
                "--keep-last": (self.keep_last, 1),
            }
        )
        _not_empty("--out-dir", self.out_dir)


@dataclass(frozen=True)
class LaunchSettings:
    """Where and how each process runs: its place among the ranks, the rendezvous, the device
    (distributed/env.py, launch.py). All said by the invocation, never by a checkpoint."""

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
    gpu: int | None = _flag(None, "use this device index only", invocation=True)
    multiprocessing_distributed: bool = _flag(
        False, "spawn --nproc-per-node processes on this node", invocation=True
    )
    no_accel: bool = _flag(
        False, "run on the CPU even when an accelerator is present", invocation=True
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

    def __post_init__(self) -> None:
        _check_values(self)
        _at_least({"--dist-timeout": (self.dist_timeout, 1)})
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


@dataclass(frozen=True)
class ReportSettings:
    """What rank 0 shows and records besides metrics.jsonl (report/)."""

    print_freq: int = _flag(10, "progress line every N steps", "-p", "--print-freq")
    progress: str = _flag(
        "auto",
        "rank 0's view of training: a bar on a terminal, plain lines elsewhere (auto), or none",
        choices=("auto", "bar", "lines", "none"),
        invocation=True,
    )
    tensorboard: bool = _flag(
        False, "also write TensorBoard event files to OUT_DIR/tensorboard", invocation=True
    )
    log_to: tuple[str, ...] = _flag(
        (),
        "also log to these experiment trackers, offline by default: MLflow in a SQLite store "
        "OUT_DIR/mlflow.db (unless MLFLOW_TRACKING_URI is set), W&B in OUT_DIR/wandb (unless "
        "WANDB_MODE is set)",
        metavar="mlflow|wandb",
        choices=("mlflow", "wandb"),
        invocation=True,
    )
    profile: int = _flag(
        0,
        "rank 0 writes a torch.profiler trace of this many training steps, after one warm-up "
        "step, to OUT_DIR/profile.json (chrome://tracing, Perfetto)",
        metavar="STEPS",
        invocation=True,
    )

    def __post_init__(self) -> None:
        _check_values(self)
        _at_least({"--print-freq": (self.print_freq, 1), "--profile": (self.profile, 0)})


# Config's attribute -> section.
SECTIONS = {
    "data": DataSettings,
    "model": ModelSettings,
    "optim": OptimSettings,
    "parallel": ParallelSettings,
    "checkpoint": CheckpointSettings,
    "launch": LaunchSettings,
    "report": ReportSettings,
}
# Each flat key -> (section, field).
_PLACES = {
    flat_key(f): (name, f.name)
    for name, section in SECTIONS.items()
    for f in dataclasses.fields(section)
}


@dataclass(frozen=True, init=False)
class Config:
    """A run's settings, by section. Built from flat keys, `Config(lr=0.1, data="x")`, as the
    flags, config files and config.json name them (an unknown key is a TypeError); `to_dict`
    gives them back flat, `replace` changes some by flat key."""

    data: DataSettings
    model: ModelSettings
    optim: OptimSettings
    parallel: ParallelSettings
    checkpoint: CheckpointSettings
    launch: LaunchSettings
    report: ReportSettings

    # Whether making a Config checks its settings against each other: config_layers.Unsettled
    # waits for a resumed checkpoint's settings first.
    checks_combinations: ClassVar[bool] = True

    def __init__(self, **flat) -> None:
        unknown = sorted(flat.keys() - _PLACES.keys())
        if unknown:
            raise TypeError(f"Config() got an unexpected keyword argument {unknown[0]!r}")
        parts: dict[str, dict] = {name: {} for name in SECTIONS}
        for key, value in flat.items():
            section, name = _PLACES[key]
            parts[section][name] = value
        for name, section in SECTIONS.items():
            object.__setattr__(self, name, section(**parts[name]))
        if self.checkpoint.evaluate and not (self.checkpoint.resume or self.model.pretrained):
            raise UserError("--evaluate needs weights: give --resume CKPT or --pretrained")
        if self.checks_combinations:
            self.check_combinations()
        self.model.check_arch()

    def check_combinations(self) -> None:
        """The settings that must agree with each other, within a section and across."""
        self.parallel.check_combinations()
        if self.parallel.ddp_comm_hook == "powersgd" and self.model.amp == "fp16":
            raise UserError(
                "--ddp-comm-hook powersgd with --amp fp16: the gradient scaler's overflowing "
                "steps would feed inf into PowerSGD's error feedback, which keeps it for every "
                "later step; use --amp bf16 or another hook"
            )
        self.data.check_combinations()
        self.optim.check_combinations()
        if self.optim.unfreeze_epoch is not None and self.parallel.ddp_comm_hook == "powersgd":
            # Unfreezing builds DDP anew for the parameters that now train, which would start
            # PowerSGD's state over where a resumed run keeps it.
            raise UserError(
                "--unfreeze-epoch with --ddp-comm-hook powersgd: unfreezing starts the hook's "
                "state over; use another hook, or --freeze-backbone alone"
            )

    def check_batch_divides(self, world_size: int) -> None:
        batch, accum_steps = self.optim.batch_size, self.optim.accum_steps
        if batch % world_size:
            raise UserError(
                f"--batch-size {batch} is the global batch and must divide evenly over "
                f"{world_size} ranks; use a multiple of {world_size}"
            )
        per_rank = batch // world_size
        if per_rank % accum_steps:
            raise UserError(
                f"--accum-steps {accum_steps} must divide each rank's share of -b "
                f"{batch} ({per_rank} on {world_size} rank(s))"
            )

    def to_dict(self) -> dict:
        """Every setting by flat key, in the order of `--help`: config.json, a checkpoint's
        `config`."""
        out = {}
        for key in _ORDER:
            section, name = _PLACES[key]
            out[key] = getattr(getattr(self, section), name)
        return out

    def replace(self, **flat) -> "Config":
        """This config with the settings `flat` names changed, checked as it was made."""
        return type(self)(**{**self.to_dict(), **flat})


# The flat keys in the order of `--help`: DATA, then HELP_GROUPS.
_ORDER = ("data", *(key for keys in HELP_GROUPS.values() for key in keys))
assert sorted(_ORDER) == sorted(_PLACES), "each setting has one place in HELP_GROUPS"


def settings() -> dict[str, dataclasses.Field]:
    """Every setting's field by flat key, in the order of `--help`."""
    fields = {flat_key(f): f for section in SECTIONS.values() for f in dataclasses.fields(section)}
    return {key: fields[key] for key in _ORDER}


# Settings that act only under another: (whether they act in a config, what they need). The
# classic example took them in silence: `--opt adamw --momentum 0.5` trained without a word
# that AdamW has no momentum, and `--lr-min` under the step schedule changed nothing.
_ACTS_ONLY_WITH = {
    "momentum": (lambda c: c.optim.opt != "adamw", "--opt sgd or sgd-nesterov"),
    "lr_step_size": (lambda c: c.optim.lr_scheduler == "step", "--lr-scheduler step"),
    "lr_gamma": (
        lambda c: c.optim.lr_scheduler in ("step", "multistep"),
        "--lr-scheduler step or multistep",
    ),
    "lr_milestones": (lambda c: c.optim.lr_scheduler == "multistep", "--lr-scheduler multistep"),
    "lr_min": (lambda c: c.optim.lr_scheduler == "cosine", "--lr-scheduler cosine"),
    "lr_warmup_decay": (lambda c: c.optim.lr_warmup_epochs > 0, "--lr-warmup-epochs above 0"),
    "lr_base_batch": (lambda c: c.optim.lr_base is not None, "--lr-base"),
    "ra_magnitude": (lambda c: c.data.auto_augment == "ra", "--auto-augment ra"),
    "model_ema_decay": (lambda c: c.optim.model_ema, "--model-ema"),
    "model_ema_steps": (lambda c: c.optim.model_ema, "--model-ema"),
    "powersgd_rank": (
        lambda c: c.parallel.ddp_comm_hook == "powersgd",
        "--ddp-comm-hook powersgd",
    ),
    "powersgd_start_step": (
        lambda c: c.parallel.ddp_comm_hook == "powersgd",
        "--ddp-comm-hook powersgd",
    ),
    "max_skipped": (lambda c: c.optim.nonfinite == "skip", "--nonfinite skip"),
}


def inert_flags(config: Config, on_command_line: frozenset[str]) -> list[str]:
    """A line for each flag given on the command line (`on_command_line`, flat keys:
    config_layers.Layers) that acts on nothing in this run, its settings merged (a resumed
    checkpoint's included). Flags, not config files: a file (a recipe, a run's config.json)
    sets many that a flag on top may leave idle."""
    return [
        f"{flag_name(name)} does nothing in this run: it acts only with {needs}"
        for name, (acts, needs) in _ACTS_ONLY_WITH.items()
        if name in on_command_line and not acts(config)
    ]


def flag_name(name: str) -> str:
    """The long flag of a flat key: `weight_decay` -> `--weight-decay`."""
    return "--" + name.replace("_", "-")


def _host_and_port(url: str) -> bool:
    parsed = urllib.parse.urlparse(url)
    try:
        return bool(parsed.hostname) and parsed.port is not None
    except ValueError:  # a port that is not a number, or out of range
        return False
