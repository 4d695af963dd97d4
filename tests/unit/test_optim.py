"""--opt, --norm-weight-decay and the LR the optimizer starts from."""

import pytest
import torch
import torchvision
from torch import nn, optim

from ddptrain.config import Config
from ddptrain.train.optim import base_lr, build_optimizer, keep_given, param_groups, settings


def tiny_convnet():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, bias=False),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Conv2d(4, 4, 3),
        nn.GroupNorm(2, 4),
        nn.Flatten(),
        nn.Linear(4 * 12 * 12, 2),
    )


def test_classic_sgd_is_one_group():
    model = tiny_convnet()
    optimizer, _ = build_optimizer(model, Config(lr=0.3, momentum=0.8, weight_decay=1e-3).optim)
    assert isinstance(optimizer, optim.SGD) and len(optimizer.param_groups) == 1
    group = optimizer.param_groups[0]
    assert (group["lr"], group["momentum"], group["weight_decay"]) == (0.3, 0.8, 1e-3)
    assert not group["nesterov"]
    assert len(group["params"]) == len(list(model.parameters()))


def test_norm_layers_and_biases_get_their_own_weight_decay():
    model = tiny_convnet()
    conv1, bn, _, conv2, gn, _, fc = model
    decay, no_decay = param_groups(model, 1e-4, 0.0)
    assert decay["weight_decay"] == 1e-4 and no_decay["weight_decay"] == 0.0
    ids = lambda ps: {id(p) for p in ps}  # noqa: E731
    assert ids(decay["params"]) == ids([conv1.weight, conv2.weight, fc.weight])
    assert ids(no_decay["params"]) == ids(
        [bn.weight, bn.bias, conv2.bias, gn.weight, gn.bias, fc.bias]
    )


def test_norm_layers_and_biases_of_a_torchvision_model_skip_weight_decay():
    model = torchvision.models.resnet18(num_classes=3)
    decay, no_decay = param_groups(model, 1e-4, 0.0)
    norm = [p for m in model.modules() if isinstance(m, nn.BatchNorm2d) for p in m.parameters()]
    assert len(no_decay["params"]) == len(norm) + 1  # and the classifier's bias
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def test_frozen_parameters_are_left_out():
    model = tiny_convnet()
    model[0].weight.requires_grad_(False)
    groups = param_groups(model, 1e-4, None)
    assert len(groups[0]["params"]) == len(list(model.parameters())) - 1


def test_nesterov_and_adamw():
    optimizer, _ = build_optimizer(tiny_convnet(), Config(opt="sgd-nesterov").optim)
    assert isinstance(optimizer, optim.SGD) and optimizer.param_groups[0]["nesterov"]
    config = Config(opt="adamw", lr=1e-3, weight_decay=0.05, norm_weight_decay=0.0)
    optimizer, _ = build_optimizer(tiny_convnet(), config.optim)
    assert isinstance(optimizer, optim.AdamW)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.05, 0.0]
    assert [g["lr"] for g in optimizer.param_groups] == [1e-3, 1e-3]


def test_linear_scaling_rule_follows_the_global_batch():
    assert base_lr(Config(lr=0.3).optim) == 0.3
    assert base_lr(Config(lr_base=0.1, lr_base_batch=256, batch_size=64).optim) == 0.025
    assert base_lr(Config(lr_base=0.5, lr_base_batch=1024, batch_size=2048).optim) == 1.0


def _stepping(config: Config, steps: int):
    """The optimizer and schedule of config, `steps` steps on (4 an epoch)."""
    optimizer, scheduler = build_optimizer(tiny_convnet(), config.optim, steps_per_epoch=4)
    for _ in range(steps):
        optimizer.step()
        scheduler.step()
    return optimizer, scheduler


def _lrs(optimizer, scheduler, steps: int) -> list[float]:
    """The LR of each group at each of the next `steps` steps."""
    seen = []
    for _ in range(steps):
        seen.extend(group["lr"] for group in optimizer.param_groups)
        optimizer.step()
        scheduler.step()
    return seen


@pytest.mark.parametrize("schedule", ["cosine", "step", "multistep"])
def test_flags_given_on_resume_win_over_the_checkpoints_settings(schedule):
    # Warmup + cosine is a SequentialLR, warmup + step a ChainedScheduler: each part rescaled.
    before = Config(
        lr=0.1,
        momentum=0.9,
        lr_scheduler=schedule,
        lr_warmup_epochs=1,
        epochs=4,
        lr_step_size=2,
        lr_milestones=[2, 3],
    )
    saved_optimizer, saved_schedule = _stepping(before, 6)  # mid-epoch 2, after the warmup
    given = before.replace(lr=0.01, momentum=0.5)
    optimizer, scheduler = build_optimizer(tiny_convnet(), given.optim, steps_per_epoch=4)
    built = settings(optimizer)
    optimizer.load_state_dict(saved_optimizer.state_dict())
    scheduler.load_state_dict(saved_schedule.state_dict())
    assert optimizer.param_groups[0]["momentum"] == 0.9  # what the load brings back
    keep_given(optimizer, built, scheduler)
    assert optimizer.param_groups[0]["momentum"] == 0.5
    # The schedule goes on as if the run had begun at LR 0.01.
    from_the_start = _stepping(given, 6)
    assert _lrs(optimizer, scheduler, 10) == pytest.approx(_lrs(*from_the_start, 10))


def test_the_same_flags_on_resume_leave_every_lr_bit_for_bit():
    config = Config(lr=0.3, lr_scheduler="cosine", lr_warmup_epochs=1, epochs=4)
    for steps in range(1, 12):
        saved_optimizer, saved_schedule = _stepping(config, steps)
        optimizer, scheduler = build_optimizer(tiny_convnet(), config.optim, steps_per_epoch=4)
        built = settings(optimizer)
        optimizer.load_state_dict(saved_optimizer.state_dict())
        scheduler.load_state_dict(saved_schedule.state_dict())
        keep_given(optimizer, built, scheduler)
        assert _lrs(optimizer, scheduler, 4) == _lrs(saved_optimizer, saved_schedule, 4), steps
