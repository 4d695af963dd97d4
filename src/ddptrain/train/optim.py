"""The optimizer from the flags (--opt, --norm-weight-decay, --lr or --lr-base), and its LR
schedule (train/schedule.py)."""

from torch import nn, optim

from ddptrain.config import OptimSettings
from ddptrain.parallel.parallelize import unwrap
from ddptrain.train.schedule import build_scheduler, fast_forward

__all__ = [
    "base_lr",
    "build_optimizer",
    "fast_forward",
    "group_lrs",
    "keep_given",
    "param_groups",
    "rebased",
    "schedule_lr",
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


def param_groups(
    model: nn.Module,
    weight_decay: float,
    norm_weight_decay: float | None,
    layers: dict[str, tuple[str, float]] | None = None,
    lr: float = 0.0,
    frozen_too: bool = False,
):
    """The model's trainable parameters, with weight decay: one group, or with
    norm_weight_decay, a second for the parameters of norm layers and all biases. With
    `layers` (name -> LR group and scale: train/finetune.lr_layers), each of those is split by
    LR group, the group's LR `lr` times its scale (`lr_scale`, which the records read).

    frozen_too: the frozen parameters as well (--freeze-backbone): --unfreeze-epoch trains
    them later, and until then the optimizer skips them, as any parameter without a gradient."""
    groups: dict[tuple[str, bool], dict] = {}
    seen = set()
    for module_name, module in unwrap(model).named_modules():
        for name, p in module.named_parameters(recurse=False):
            if id(p) in seen or not (p.requires_grad or frozen_too):
                continue
            seen.add(id(p))
            norm = isinstance(module, NORM_LAYERS) or name == "bias"
            decays = norm_weight_decay is None or not norm
            label, scale = ("all", 1.0)
            if layers is not None:
                label, scale = layers[f"{module_name}.{name}" if module_name else name]
            if (label, decays) not in groups:
                group = {"params": []}
                if norm_weight_decay is not None:
                    group["weight_decay"] = weight_decay if decays else norm_weight_decay
                if layers is not None:
                    group.update(lr=lr * scale, lr_scale=scale, layer=label)
                groups[label, decays] = group
            groups[label, decays]["params"].append(p)
    # By layer from the input, each with its decayed parameters first.
    labels = list(dict.fromkeys(label for label, _ in groups))
    order = sorted(groups, key=lambda key: (labels.index(key[0]), not key[1]))
    return [groups[key] for key in order]


def schedule_lr(optimizer: optim.Optimizer) -> float:
    """The LR the schedule gives now, which each group's `lr_scale` multiplies (one without
    layers has none: its LR, bit for bit)."""
    group = optimizer.param_groups[0]
    return group["lr"] / group.get("lr_scale", 1.0)


def group_lrs(optimizer: optim.Optimizer, lr: float) -> dict[str, float]:
    """Each LR group's LR for a schedule LR `lr`, by its layer (for the records); none without
    --layer-decay or --head-lr-scale."""
    return {g["layer"]: lr * g["lr_scale"] for g in optimizer.param_groups if "layer" in g}


def build_optimizer(
    model: nn.Module,
    config: OptimSettings,
    steps_per_epoch: int = 1,
    layers: dict[str, tuple[str, float]] | None = None,
    frozen_too: bool = False,
) -> tuple[optim.Optimizer, optim.lr_scheduler.LRScheduler]:
    """The optimizer over model's parameters (the wrapped model's are the same tensors) and
    its schedule, to be stepped after every optimizer step. steps_per_epoch converts the
    schedule's epochs to steps; 1 (the default) serves a trainer that steps it once per epoch,
    with the LR then changing at epoch boundaries only. layers, frozen_too: see param_groups."""
    lr = base_lr(config)
    groups = param_groups(
        model, config.weight_decay, config.norm_weight_decay, layers, lr, frozen_too
    )
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
