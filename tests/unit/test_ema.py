"""The EMA of weights and buffers: its update rule, its schedule of updates, and a checkpoint
round trip that continues bitwise."""

import io

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from ddptrain.config import Config
from ddptrain.distributed.env import DistEnv
from ddptrain.train.ema import ModelEma, build_ema

ONE = DistEnv(0, 1, 0, 1, torch.device("cpu"))


def net(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(64, 2))


def train_step(model, seed):
    """Moves every parameter and the BatchNorm statistics, as a training step would."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g))
    model.train()
    model(torch.randn(4, 3, 6, 6, generator=g))


def float_state(model):
    return {k: v.clone() for k, v in model.state_dict().items() if v.is_floating_point()}


def test_update_is_decay_times_average_plus_the_rest_times_the_weights():
    model = net()
    ema = ModelEma(model, ONE, decay=0.9)
    train_step(model, 1)
    ema.update(model, step=1)  # the first update copies
    expected = float_state(model)
    assert all(torch.equal(v, float_state(ema.module)[k]) for k, v in expected.items())
    for step in range(2, 5):
        train_step(model, step)
        ema.update(model, step)
        current = float_state(model)
        expected = {k: 0.9 * v + 0.1 * current[k] for k, v in expected.items()}
        averaged = float_state(ema.module)
        for k, v in expected.items():  # weights and BatchNorm running statistics
            assert torch.allclose(averaged[k], v, rtol=1e-6, atol=1e-7), k
    assert ema.state_dict()["updates"] == 4


def test_the_average_is_torch_s_averaged_model_s():
    """The same arithmetic as AveragedModel(use_buffers=True) with torch's EMA function, which
    ModelEma replaces because FSDP2 cannot use it (see ema.py): bitwise, batch counts too."""
    model = net()
    ema = ModelEma(model, ONE, decay=0.9)
    reference = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=True)
    for step in range(1, 6):
        train_step(model, step)
        ema.update(model, step)
        reference.update_parameters(model)
    for k, v in reference.module.state_dict().items():
        assert torch.equal(ema.module.state_dict()[k], v), k


def test_every_k_steps_with_decay_to_the_k():
    model = net()
    ema = ModelEma(model, ONE, decay=0.9, every=3)
    reference = ModelEma(net(), ONE, decay=0.9**3)
    for step in range(1, 10):
        train_step(model, step)
        ema.update(model, step)
        if step % 3 == 0:
            reference.update(model, step // 3)
    assert ema.state_dict()["updates"] == 3
    for k, v in float_state(reference.module).items():
        assert torch.equal(float_state(ema.module)[k], v)


def test_during_warmup_the_average_is_the_current_model():
    model = net()
    ema = ModelEma(model, ONE, decay=0.99, warmup_steps=3)
    for step in range(1, 5):
        train_step(model, step)
        ema.update(model, step)
        same = all(
            torch.equal(v, float_state(ema.module)[k]) for k, v in float_state(model).items()
        )
        assert same == (step <= 3)


def saved(ema) -> dict:
    buffer = io.BytesIO()
    torch.save(ema.state_dict(), buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def test_checkpoint_round_trip_continues_bitwise():
    config = Config(model_ema=True, model_ema_decay=0.95, model_ema_steps=2)
    model = net()
    uninterrupted = build_ema(model, config.optim, ONE, steps_per_epoch=10)
    for step in range(1, 8):
        train_step(model, step)
        uninterrupted.update(model, step)
        if step == 5:
            state = saved(uninterrupted)
            weights = {k: v.clone() for k, v in model.state_dict().items()}
    resumed_model = net(seed=1)
    resumed_model.load_state_dict(weights)
    resumed = build_ema(net(seed=2), config.optim, ONE, steps_per_epoch=10)
    resumed.load_state_dict(state)
    for step in range(6, 8):
        train_step(resumed_model, step)
        resumed.update(resumed_model, step)
    for k, v in uninterrupted.module.state_dict().items():
        assert torch.equal(resumed.module.state_dict()[k], v), k
    assert resumed.state_dict()["updates"] == uninterrupted.state_dict()["updates"] == 3


def test_its_state_is_a_plain_model_state_dict():
    ema = ModelEma(net(), ONE, decay=0.9)
    state = saved(ema)
    assert set(state["model"]) == set(net().state_dict())  # no "module." prefix
    net(seed=3).load_state_dict(state["model"], strict=True)


def test_off_by_default():
    assert build_ema(net(), Config().optim, ONE, steps_per_epoch=5) is None
    ema = build_ema(
        net(), Config(model_ema=True, lr_warmup_epochs=1.5).optim, ONE, steps_per_epoch=4
    )
    assert (ema.every, ema.warmup_steps) == (32, 6)


def set_weights(model, value):
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)


def first_weight(ema):
    return next(ema.module.parameters()).flatten()[0].item()


def test_a_short_run_s_average_follows_the_model_not_its_first_weights():
    """200 steps against a decay of 0.998 (a horizon of 500 steps), the weights moving from 1 to
    200 by one a step: the average holds the run's last stretch; at the plain decay it would
    still hold mostly the first weights."""
    config = Config(model_ema=True, model_ema_decay=0.998, model_ema_steps=1)
    model = net()
    ema = build_ema(model, config.optim, ONE, steps_per_epoch=20)
    for step in range(1, 201):
        set_weights(model, step)
        ema.update(model, step)
    assert abs(first_weight(ema) - 180) < 0.5  # a tenth of the updates behind
    plain = ModelEma(model, ONE, decay=0.998)
    for step in range(1, 201):
        set_weights(model, step)
        plain.update(model, step)
    assert first_weight(plain) < 60


def test_the_warm_up_begins_where_the_lr_warmup_s_restarts_end():
    config = Config(model_ema=True, model_ema_decay=0.998, model_ema_steps=1, lr_warmup_epochs=2)
    ema = build_ema(net(), config.optim, ONE, steps_per_epoch=5)
    model = net()
    for step in range(1, 11):  # the LR warmup: each update copies the weights
        set_weights(model, step)
        ema.update(model, step)
        assert first_weight(ema) == step
    set_weights(model, 11)
    ema.update(model, 11)  # the first averaging update, at the warm-up's first decay
    assert abs(first_weight(ema) - (2 / 11 * 10 + 9 / 11 * 11)) < 1e-5
    assert ema.updates == 2


def test_a_long_run_s_decay_is_the_configured_one():
    """The decay reaches D^K after about 9 / (1 - D) steps and stays there: each update then
    weighs the average by D^K and the weights by 1 - D^K."""
    for every in (1, 4):
        config = Config(model_ema=True, model_ema_decay=0.99, model_ema_steps=every)
        model = net()
        ema = build_ema(model, config.optim, ONE, steps_per_epoch=10)
        decays = []
        for step in range(1, 1200 * every + 1):
            if step % every == 0:
                decays.append(ema.current_decay())
            ema.update(model, step)
        assert decays[0] == 0.0 and decays == sorted(decays)
        assert decays[-1] == 0.99**every
        full = decays.index(0.99**every)
        assert 850 <= full * every <= 900, full  # (1 + n) / (10 + n) >= D^K
        train_step(model, 1)
        before, current = float_state(ema.module), float_state(model)
        ema.update(model, 1200 * every + every)
        for k, v in float_state(ema.module).items():
            expected = 0.99**every * before[k] + (1 - 0.99**every) * current[k]
            assert torch.allclose(v, expected, rtol=1e-6, atol=1e-7), k
