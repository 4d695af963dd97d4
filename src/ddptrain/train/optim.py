"""SGD with momentum and weight decay, and the classic example's step schedule."""

import warnings

from torch import nn, optim

from ddptrain.config import Config

STEP_EPOCHS, STEP_GAMMA = 30, 0.1  # the classic example: lr / 10 every 30 epochs


def build_optimizer(
    model: nn.Module, config: Config
) -> tuple[optim.Optimizer, optim.lr_scheduler.LRScheduler]:
    optimizer = optim.SGD(
        model.parameters(), config.lr, momentum=config.momentum, weight_decay=config.weight_decay
    )
    scheduler = optim.lr_scheduler.StepLR(optimizer, STEP_EPOCHS, STEP_GAMMA)
    return optimizer, scheduler


def fast_forward(scheduler: optim.lr_scheduler.LRScheduler, epochs: int) -> None:
    """Puts a fresh schedule at `epochs` (for --start-epoch without a checkpoint)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "scheduler.step() before optimizer.step()"
        for _ in range(epochs):
            scheduler.step()
