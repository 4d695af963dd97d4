import pytest
import torch
from torch import nn

from ddptrain.config import Config
from ddptrain.errors import UserError
from ddptrain.model.precision import Precision, resolve_precision
from ddptrain.train.trainer import Step

CPU = torch.device("cpu")


def convnet():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 4),
    )


def test_defaults_channels_last_for_convolutional_models_only():
    assert resolve_precision(Config(), None, convnet(), CPU).settings() == {
        "amp": "none",
        "channels_last": True,
        "compile": False,
    }
    mlp = nn.Sequential(nn.Flatten(), nn.Linear(12, 4))
    assert not resolve_precision(Config(), None, mlp, CPU).channels_last


def test_flags_win_and_a_resumed_run_keeps_its_settings():
    saved = {"amp": "bf16", "channels_last": False, "compile": True}
    assert resolve_precision(Config(), saved, convnet(), CPU).settings() == saved
    flags = Config(amp="none", channels_last=True, compile=False)
    assert resolve_precision(flags, saved, convnet(), CPU).settings() == {
        "amp": "none",
        "channels_last": True,
        "compile": False,
    }


def test_fp16_needs_cuda_and_unknown_modes_are_refused():
    with pytest.raises(UserError, match="--amp fp16"):
        resolve_precision(Config(amp="fp16"), None, convnet(), CPU)
    with pytest.raises(UserError, match="--amp"):
        Config(amp="fp8")


def test_channels_last_inputs_and_model():
    p = Precision("cpu", channels_last=True)
    images = p.inputs(torch.randn(2, 3, 8, 8), CPU)
    assert images.is_contiguous(memory_format=torch.channels_last)
    model = p.place(convnet(), CPU)
    assert model[0].weight.is_contiguous(memory_format=torch.channels_last)


def test_bf16_training_computes_in_bf16_and_its_loss_falls():
    model = convnet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    p = Precision("cpu", amp="bf16", channels_last=True)
    images = p.inputs(torch.randn(16, 3, 8, 8), CPU)
    target = torch.arange(16) % 4
    losses = []
    for _ in range(30):
        loss, output = Step(model, optimizer, p)(images, target)
        losses.append(loss.item())
    assert output.dtype == torch.bfloat16
    assert model[0].weight.dtype == torch.float32  # master weights stay fp32
    assert losses[-1] < 0.5 * losses[0]
