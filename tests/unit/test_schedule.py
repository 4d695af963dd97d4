"""Every schedule's LR at every optimizer step, against a closed form or torch's per-epoch
scheduler, warmup included; and a mid-epoch resume from state_dict that continues exactly."""

import math
import warnings

import pytest
import torch
from torch import nn, optim

from ddptrain.config import Config
from ddptrain.train.optim import build_optimizer
from ddptrain.train.schedule import fast_forward, no_warmup_warning

STEPS = 7  # optimizer steps per epoch


def model():
    torch.manual_seed(0)
    return nn.Linear(3, 2)


def curve(config: Config, steps_per_epoch=STEPS, steps=None):
    """The LR of each optimizer step, stepping the schedule after each, as the trainer does."""
    optimizer, scheduler = build_optimizer(model(), config.optim, steps_per_epoch)
    lrs = []
    for _ in range(steps or config.optim.epochs * steps_per_epoch):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return lrs


def assert_close(lrs, expected):
    assert len(lrs) == len(expected)
    for step, (got, want) in enumerate(zip(lrs, expected, strict=True)):
        assert got == pytest.approx(want, rel=1e-12, abs=1e-15), step


def warmup_factor(step, warmup, decay):
    return decay + (1 - decay) * step / warmup if step < warmup else 1.0


def test_the_default_is_the_classic_step_schedule_changing_at_epoch_boundaries():
    config = Config(epochs=70, lr=0.1)
    lrs = curve(config)
    # torch's StepLR(30, 0.1) stepped once per epoch, as the classic example does
    optimizer = optim.SGD(model().parameters(), 0.1)
    per_epoch = optim.lr_scheduler.StepLR(optimizer, 30, 0.1)
    expected = []
    for _ in range(70):
        expected += [optimizer.param_groups[0]["lr"]] * STEPS
        optimizer.step()
        per_epoch.step()
    assert_close(lrs, expected)
    assert lrs[30 * STEPS - 1] == 0.1 and lrs[30 * STEPS] == pytest.approx(0.01)


def test_step_per_epoch_builder_for_a_trainer_that_steps_once_an_epoch():
    assert_close(curve(Config(epochs=65), steps_per_epoch=1), [0.1] * 30 + [0.01] * 30 + [1e-3] * 5)


def test_step_with_warmup():
    config = Config(epochs=12, lr=0.4, lr_step_size=4, lr_gamma=0.5, lr_warmup_epochs=2)
    warmup = 2 * STEPS
    expected = [
        0.4 * warmup_factor(t, warmup, 0.01) * 0.5 ** (t // (4 * STEPS)) for t in range(12 * STEPS)
    ]
    assert_close(curve(config), expected)


def test_a_warmup_shorter_than_half_a_step_is_named_as_none():
    short = Config(lr=0.1, lr_warmup_epochs=0.05, epochs=2)  # 0.35 of a step at STEPS
    assert curve(short)[0] == 0.1  # no ramp: the full LR from the first step
    line = no_warmup_warning(short.optim, STEPS)
    assert line.startswith("--lr-warmup-epochs 0.05 rounds to 0 of the 7 steps per epoch")
    assert line.endswith("there is no warmup; give more than 0.0714 for one step")
    assert no_warmup_warning(Config(lr_warmup_epochs=0.0714).optim, STEPS)  # 0.4998 rounds to 0
    assert curve(Config(lr=0.1, lr_warmup_epochs=0.0715, epochs=2))[0] < 0.1  # 0.5005: ramps
    assert no_warmup_warning(Config(lr_warmup_epochs=0.1).optim, STEPS) is None  # 0.7: one step
    assert no_warmup_warning(Config(lr_warmup_epochs=0).optim, STEPS) is None  # none asked for


def test_multistep_drops_at_its_epochs_warmup_or_not():
    config = Config(epochs=10, lr=1.0, lr_scheduler="multistep", lr_milestones=(3, 7))
    drops = lambda t: 0.1 ** sum(t >= m * STEPS for m in (3, 7))  # noqa: E731
    assert_close(curve(config), [drops(t) for t in range(10 * STEPS)])
    warm = Config(
        epochs=10,
        lr=1.0,
        lr_scheduler="multistep",
        lr_milestones=(3, 7),
        lr_warmup_epochs=1.5,
        lr_warmup_decay=0.1,
    )
    warmup = round(1.5 * STEPS)
    expected = [warmup_factor(t, warmup, 0.1) * drops(t) for t in range(10 * STEPS)]
    assert_close(curve(warm), expected)


@pytest.mark.parametrize("warmup_epochs", [0, 1, 2.5])
def test_cosine_after_a_linear_warmup(warmup_epochs):
    config = Config(
        epochs=9,
        lr=0.5,
        lr_scheduler="cosine",
        lr_min=1e-3,
        lr_warmup_epochs=warmup_epochs,
        lr_warmup_decay=0.01,
    )
    warmup, total = round(warmup_epochs * STEPS), 9 * STEPS

    def closed_form(t):
        if t < warmup:
            return 0.5 * warmup_factor(t, warmup, 0.01)
        return 1e-3 + (0.5 - 1e-3) * (1 + math.cos(math.pi * (t - warmup) / (total - warmup))) / 2

    lrs = curve(config)
    assert_close(lrs, [closed_form(t) for t in range(total)])
    assert all(b > a for a, b in zip(lrs[:warmup], lrs[1 : warmup + 1], strict=True))


def test_none_is_constant_after_the_warmup():
    assert_close(curve(Config(epochs=3, lr=0.2, lr_scheduler="none")), [0.2] * 3 * STEPS)
    config = Config(epochs=3, lr=0.2, lr_scheduler="none", lr_warmup_epochs=1)
    expected = [0.2 * warmup_factor(t, STEPS, 0.01) for t in range(3 * STEPS)]
    assert_close(curve(config), expected)


def test_linear_scaling_rule():
    config = Config(epochs=1, lr_base=0.1, lr_base_batch=256, batch_size=1024)
    assert curve(config)[0] == pytest.approx(0.4)


@pytest.mark.parametrize(
    "config",
    [
        Config(epochs=6, lr_scheduler="cosine", lr_warmup_epochs=2),
        Config(epochs=6, lr_step_size=2, lr_warmup_epochs=1),
        Config(epochs=6, lr_scheduler="multistep", lr_milestones=(2, 4), lr_warmup_epochs=1),
    ],
    ids=["cosine", "step", "multistep"],
)
def test_a_schedule_resumed_mid_epoch_from_its_state_continues_exactly(config):
    uninterrupted = curve(config)
    for stop in (3, STEPS + 4, 3 * STEPS + 2):  # in the warmup, just after, later
        first_optimizer, first = build_optimizer(model(), config.optim, STEPS)
        for _ in range(stop):
            first_optimizer.step()
            first.step()
        saved = (first_optimizer.state_dict(), first.state_dict())
        optimizer, scheduler = build_optimizer(model(), config.optim, STEPS)
        optimizer.load_state_dict(saved[0])
        scheduler.load_state_dict(saved[1])
        resumed = []
        for _ in range(stop, 6 * STEPS):
            resumed.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            scheduler.step()
        assert resumed == uninterrupted[stop:]  # bitwise


def test_fast_forward_puts_a_fresh_schedule_at_a_step():
    config = Config(epochs=8, lr_scheduler="cosine", lr_warmup_epochs=1)
    optimizer, scheduler = build_optimizer(model(), config.optim, STEPS)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # fast_forward silences torch's order warning itself
        fast_forward(scheduler, 3 * STEPS + 1)
    assert optimizer.param_groups[0]["lr"] == curve(config)[3 * STEPS + 1]
