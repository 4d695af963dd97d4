"""The optimizer from the flags (--opt, --norm-weight-decay, --lr or --lr-base), and its LR
schedule (train/schedule.py)."""

from torch import nn, optim

from ddptrain.config import OptimSettings
from ddptrain.train.schedule import build_scheduler, fast_forward

__all__ = [
    "base_lr",
    "build_optimizer",
    "fast_forward",
    "keep_given",
    "param_groups",
    "rebased",
    "settings",
]

# Layers whose parameters scale activations rather than mix them, which weight decay would
# only pull towards zero (torchvision's references: `set_weight_decay`).
NORM_LAYERS = (
    nn.modules.batchnorm._BatchNorm,
    nn.modules.instancenorm._InstanceNorm,
    nn.LayerNorm,
    nn.GroupNorm,
    nn.LocalResponseNorm,
)


def base_lr(config: OptimSettings) -> float:
    """The LR the schedule starts from (after any warmup): --lr, or with the linear scaling
    rule --lr-base x global batch / --lr-base-batch."""
    if config.lr_base is not None:
        return config.lr_base * config.batch_size / config.lr_base_batch
    return config.lr


def param_groups(model: nn.Module, weight_decay: float, norm_weight_decay: float | None):
    """The model's trainable parameters, with weight decay: one group, or with
    norm_weight_decay, a second for the parameters of norm layers and all biases."""
    if norm_weight_decay is None:
        return [{"params": [p for p in model.parameters() if p.requires_grad]}]
    decay, no_decay, seen = [], [], set()
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            norm = isinstance(module, NORM_LAYERS) or name == "bias"
            (no_decay if norm else decay).append(p)
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": norm_weight_decay},
    ]
    return [g for g in groups if g["params"]]


def build_optimizer(
    model: nn.Module, config: OptimSettings, steps_per_epoch: int = 1
) -> tuple[optim.Optimizer, optim.lr_scheduler.LRScheduler]:
    """The optimizer over model's parameters (the wrapped model's are the same tensors) and
    its schedule, to be stepped after every optimizer step. steps_per_epoch converts the
    schedule's epochs to steps; 1 (the default) serves a trainer that steps it once per epoch,
    with the LR then changing at epoch boundaries only."""
    groups = param_groups(model, config.weight_decay, config.norm_weight_decay)
    lr = base_lr(config)
    if config.opt == "adamw":
        optimizer = optim.AdamW(groups, lr=lr, weight_decay=config.weight_decay)
    else:
        optimizer = optim.SGD(
            groups,
            lr,
            momentum=config.momentum,
            weight_decay=config.weight_decay,
            nesterov=config.opt == "sgd-nesterov",
        )
    return optimizer, build_scheduler(optimizer, config, steps_per_epoch)


def settings(optimizer: optim.Optimizer) -> list[dict]:
    """What each param group holds besides its parameters (lr, momentum, weight decay, ...)."""
    return [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]


def keep_given(
    optimizer: optim.Optimizer,
    built: list[dict],
    scheduler: optim.lr_scheduler.LRScheduler | None,
) -> list[tuple[float, float]]:
    """After a checkpoint's optimizer (and `scheduler`, when loaded too) are loaded, which bring
    back the settings they were saved with: the settings this run was built with (`built`,
    taken before the load), which hold the flags given on resume (a flag given wins: --lr,
    --momentum, --wd). A new base LR scales the schedule under way, every LR it gave and will
    give by new / old, so its shape (warmup, steps, cosine) goes on from where it was (a
    cosine still ends at --lr-min). Returns each group's (base LR saved, base LR now), for
    `rebased`."""
    groups = optimizer.param_groups
    bases = []  # per group: the base LR saved, and this run's
    for group, given in zip(groups, built, strict=True):
        bases.append((group.get("initial_lr", given["initial_lr"]), given["initial_lr"]))
        group["lr"] = rebased(group["lr"], *bases[-1])
        group.update({k: v for k, v in given.items() if k != "lr"})
    if scheduler is None or all(old == new for old, new in bases):
        return bases  # the schedule's own state as saved, bit for bit: resume is exact
    # SequentialLR and ChainedScheduler keep no base LRs of their own: their parts (in
    # _schedulers) do.
    for part in [scheduler, *getattr(scheduler, "_schedulers", [])]:
        if hasattr(part, "base_lrs"):
            part.base_lrs = [rebased(lr, *b) for lr, b in zip(part.base_lrs, bases, strict=True)]
        part._last_lr = [group["lr"] for group in groups]
    return bases


def rebased(lr: float, old: float, new: float) -> float:
    """An LR of a schedule from base `old`, in the same schedule from base `new` (one from 0
    gave 0 all along: then `new`). The same base leaves it as it is, bit for bit: lr * b / b
    need not be lr in floating point, and resume is bitwise."""
    if new == old:
        return lr
    return lr * new / old if old else new
