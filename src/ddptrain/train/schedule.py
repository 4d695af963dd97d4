"""Learning-rate schedules from the flags, stepped after every optimizer step.

`build_scheduler(optimizer, config, steps_per_epoch)` composes torch's own schedulers, with
every length given in epochs converted to optimizer steps:

- step (the default, the classic example's): StepLR, x --lr-gamma every --lr-step-size
  epochs, so the LR still changes only at epoch boundaries;
- multistep: MultiStepLR, x --lr-gamma at each of --lr-milestones (epochs);
- cosine: CosineAnnealingLR from the LR down to --lr-min, over the epochs after the warmup
  (as torchvision's references);
- none: a constant LR.

`--lr-warmup-epochs W` puts a linear warmup in front, from LR x --lr-warmup-decay up to the LR
at step round(W x steps_per_epoch); it multiplies step and multistep, whose drops stay at their
epochs (ChainedScheduler), and hands over to the cosine, which then starts (SequentialLR).
Stepping per optimizer step makes the warmup smooth, and a schedule resumed from its
`state_dict` mid-epoch continues exactly. The schedule's parameters are part of that state:
a resume that changes them is refused (state/resume.check_continuable), since the load would
undo the change.
"""

import warnings

from torch import optim
from torch.optim import lr_scheduler

from ddptrain.config import OptimSettings


def build_scheduler(
    optimizer: optim.Optimizer, config: OptimSettings, steps_per_epoch: int
) -> lr_scheduler.LRScheduler:
    """The schedule of `optimizer`'s LR; call its step() after every optimizer step.
    steps_per_epoch: optimizer steps in one epoch (1 for a trainer that steps it per epoch)."""
    assert steps_per_epoch >= 1
    total = config.epochs * steps_per_epoch
    warmup = warmup_steps(config, steps_per_epoch)
    kind = config.lr_scheduler
    if kind == "step":
        main = lr_scheduler.StepLR(
            optimizer, config.lr_step_size * steps_per_epoch, config.lr_gamma
        )
    elif kind == "multistep":
        milestones = [m * steps_per_epoch for m in config.lr_milestones]
        main = lr_scheduler.MultiStepLR(optimizer, milestones, config.lr_gamma)
    elif kind == "cosine":
        after_warmup = max(1, total - warmup)
        main = lr_scheduler.CosineAnnealingLR(optimizer, after_warmup, eta_min=config.lr_min)
    else:
        main = lr_scheduler.ConstantLR(optimizer, factor=1.0, total_iters=0)
    if warmup == 0:
        return main
    ramp = lr_scheduler.LinearLR(optimizer, start_factor=config.lr_warmup_decay, total_iters=warmup)
    if kind == "cosine":
        return lr_scheduler.SequentialLR(optimizer, [ramp, main], milestones=[warmup])
    return lr_scheduler.ChainedScheduler([ramp, main], optimizer=optimizer)


def warmup_steps(config: OptimSettings, steps_per_epoch: int) -> int:
    return round(config.lr_warmup_epochs * steps_per_epoch)


def no_warmup_warning(config: OptimSettings, steps_per_epoch: int) -> str | None:
    """A warmup asked for that rounds to no step: the run would start at the full LR unawares."""
    if config.lr_warmup_epochs <= 0 or warmup_steps(config, steps_per_epoch) > 0:
        return None
    return (
        f"--lr-warmup-epochs {config.lr_warmup_epochs:g} rounds to 0 of the {steps_per_epoch} "
        f"steps per epoch: there is no warmup; give more than {0.5 / steps_per_epoch:.3g} for "
        "one step"
    )


def fast_forward(scheduler: lr_scheduler.LRScheduler, steps: int) -> None:
    """Puts a fresh schedule where it is after `steps` steps (--start-epoch without a
    checkpoint: start_epoch x the steps per epoch the schedule was built with)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "scheduler.step() before optimizer.step()"
        for _ in range(steps):
            scheduler.step()
