import os
import threading

import pytest
import torch
from torch import nn

from ddptrain.config import Config
from ddptrain.distributed.env import DistEnv
from ddptrain.errors import UserError
from ddptrain.model import precision
from ddptrain.model.build import build_model
from ddptrain.model.precision import (
    Precision,
    auto_amp,
    bf16_units,
    cpu_bf16_units,
    resolve_precision,
    strided_single_pixel,
)
from ddptrain.parallel.parallelize import ReplicaAutocast, unwrap, wrap
from ddptrain.train.step import Step

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


def resolve(config: Config, saved: dict | None, model: nn.Module):
    """resolve_precision as a run calls it: the model's settings, its train crop and seed."""
    seeded = config.optim.seed is not None
    return resolve_precision(
        config.model, saved, model, CPU, image_size=config.data.image_size, seeded=seeded
    )


def test_defaults_channels_last_for_convolutional_models_only():
    # amp: --amp auto's choice for this machine's CPU (the default since --amp auto)
    assert resolve(Config(), None, convnet()).settings() == {
        "amp": auto_amp("cpu", bf16_units(CPU))[0],
        "channels_last": True,
        "compile": False,
    }
    mlp = nn.Sequential(nn.Flatten(), nn.Linear(12, 4))
    assert not resolve(Config(), None, mlp).channels_last


def test_flags_win_and_a_resumed_run_keeps_its_settings():
    saved = {"amp": "bf16", "channels_last": False, "compile": True}
    assert resolve(Config(), saved, convnet()).settings() == saved
    flags = Config(amp="none", channels_last=True, compile=False)
    assert resolve(flags, saved, convnet()).settings() == {
        "amp": "none",
        "channels_last": True,
        "compile": False,
    }


def test_under_fsdp_channels_last_stays_on():
    # Under fsdp channels_last lays out the batches (the parameters stay contiguous, as FSDP2
    # shards them): on by default for convolutional models, as under ddp, and taken when given.
    fsdp = Config(strategy="fsdp")
    assert resolve(fsdp, None, convnet()).channels_last
    given = Config(strategy="fsdp", channels_last=True)
    assert resolve(given, None, convnet()).channels_last


def test_fp16_needs_cuda_and_unknown_modes_are_refused():
    with pytest.raises(UserError, match="--amp fp16"):
        resolve(Config(amp="fp16"), None, convnet())
    with pytest.raises(UserError, match="--amp"):
        Config(amp="fp8")


def test_channels_last_inputs_and_model():
    p = Precision("cpu", channels_last=True)
    images = p.inputs(torch.randn(2, 3, 8, 8), CPU)
    assert images.is_contiguous(memory_format=torch.channels_last)
    model = p.place(convnet(), CPU)
    assert model[0].weight.is_contiguous(memory_format=torch.channels_last)


def test_bf16_training_computes_in_bf16_and_steps_its_fp32_weights():
    # Mechanisms, not a trajectory: how far a loss falls differs between CPUs (AMX, AVX-512
    # with bf16 units, emulated bf16), which round bf16 differently.
    model, reference = convnet(), convnet()
    lr = 0.5
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    p = Precision("cpu", amp="bf16", channels_last=True)
    images = p.inputs(torch.randn(16, 3, 8, 8), CPU)
    target = torch.arange(16) % 4
    before = [w.detach().clone() for w in model.parameters()]
    loss, output, _ = Step(model, optimizer, p)(images, target)
    assert output.dtype == torch.bfloat16
    for weight, earlier in zip(model.parameters(), before, strict=True):
        assert weight.dtype == weight.grad.dtype == torch.float32  # master weights stay fp32
        assert torch.isfinite(weight.grad).all() and weight.grad.abs().sum() > 0
        torch.testing.assert_close(weight.detach(), earlier - lr * weight.grad)  # stepped by it
    # the bf16 forward computes the fp32 one's loss, to bf16's precision
    fp32_loss = nn.functional.cross_entropy(reference(images.float()), target)
    assert loss.item() == pytest.approx(fp32_loss.item(), rel=2e-2)


@pytest.mark.parametrize("kind", ["cuda", "cpu", "xpu"])
def test_auto_takes_bf16_where_the_device_has_bf16_units(kind):
    amp, reason = auto_amp(kind, has_bf16_units=True)
    assert amp == "bf16" and reason == f"auto: the {kind} device has bf16 units"
    amp, reason = auto_amp(kind, has_bf16_units=False)
    assert amp == "none" and "no bf16 units" in reason


def test_auto_keeps_a_seeded_cpu_run_in_fp32_where_bf16_would_not_repeat():
    amp, reason = auto_amp("cpu", has_bf16_units=True, bitwise=True)
    assert amp == "none" and "--seed" in reason
    assert auto_amp("cuda", has_bf16_units=True, bitwise=True)[0] == "bf16"


@pytest.mark.parametrize(
    ("cpu", "machine", "avx512_bf16", "amx", "onednn_bf16", "units"),
    [
        ("AVX2 only", "x86_64", False, False, False, False),
        # oneDNN emulates bf16 on plain AVX-512 and says it supports it: 4x slower than fp32
        ("AVX-512 without bf16", "x86_64", False, False, True, False),
        ("avx512_bf16", "x86_64", True, False, True, True),
        ("AMX", "x86_64", True, True, True, True),
        ("Arm with the bf16 extension", "aarch64", False, False, True, True),
        ("Arm without it", "aarch64", False, False, False, False),
    ],
)
def test_a_cpu_has_bf16_units_only_where_it_computes_bf16_in_hardware(
    cpu, machine, avx512_bf16, amx, onednn_bf16, units
):
    assert cpu_bf16_units(machine, avx512_bf16, amx, onednn_bf16) is units, cpu


def test_auto_takes_fp32_on_other_devices():
    assert auto_amp("mps", has_bf16_units=True)[0] == "none"
    assert auto_amp("mps", has_bf16_units=False)[0] == "none"


def test_auto_is_resolved_before_it_is_saved_and_a_resumed_choice_stays(monkeypatch):
    monkeypatch.setattr(precision, "bf16_units", lambda device: True)
    chosen = resolve(Config(amp="auto"), None, convnet())
    assert chosen.settings()["amp"] == "bf16"  # what config.json and the checkpoint keep
    assert chosen.amp_choice() == "bf16 (auto: the cpu device has bf16 units)"
    assert resolve(Config(seed=0), None, convnet()).amp == "none"
    monkeypatch.setattr(precision, "bf16_units", lambda device: False)
    assert resolve(Config(), None, convnet()).amp == "none"
    # a run resumed on a machine without bf16 units keeps the bf16 its first run chose
    resumed = resolve(Config(), {"amp": "bf16"}, convnet())
    assert resumed.amp == "bf16" and resumed.amp_choice() == "bf16"


def test_bf16_on_a_cpu_without_bf16_units_warns_that_it_is_emulated(monkeypatch):
    monkeypatch.setattr(precision, "bf16_units", lambda device: False)
    slow = resolve(Config(amp="bf16"), None, convnet())
    assert slow.amp == "bf16" and "emulated and slower" in slow.warning
    monkeypatch.setattr(precision, "bf16_units", lambda device: True)
    assert resolve(Config(amp="bf16"), None, convnet()).warning is None


def test_a_strided_convolution_of_a_1x1_map_is_found_by_shapes_alone():
    resnet18 = build_model("resnet18", 10, 16, False, meta=True)  # no weights: shapes only
    assert strided_single_pixel(resnet18, 16) == "layer4.0.conv1"
    assert strided_single_pixel(resnet18, 32) is None  # its input is 2x2 there
    real = build_model("resnet18", 10, 16, False)
    before = {name: t.clone() for name, t in real.state_dict().items()}
    assert strided_single_pixel(real, 16) == "layer4.0.conv1"
    assert all(torch.equal(t, before[name]) for name, t in real.state_dict().items())
    assert not any(conv._forward_pre_hooks for conv in real.modules())


def test_auto_keeps_a_cpu_run_in_fp32_where_bf16_is_wrong():
    amp, reason = auto_amp("cpu", True, strided_single_pixel="layer4.0.conv1")
    assert amp == "none" and "layer4.0.conv1 convolves a 1x1 map" in reason
    assert auto_amp("cuda", True, strided_single_pixel="layer4.0.conv1")[0] == "bf16"
    model = build_model("resnet18", 10, 16, False)
    small, given = Config(image_size=16), Config(image_size=16, amp="bf16")
    assert resolve(small, None, model).amp == "none"
    warning = resolve(given, None, model).warning
    if bf16_units(CPU):  # else the warning says that bf16 is emulated
        assert "layer4.0.conv1 convolves a 1x1 map" in warning and "--amp none" in warning
        assert resolve(Config(image_size=32), None, model).amp == "bf16"


def test_each_dataparallel_replica_computes_in_the_runs_dtype():
    # torch's parallel_apply runs each replica in a thread of its own, entering
    # `autocast("cuda", enabled=...)` without a dtype: there the default, fp16.
    seen = []

    class Probe(nn.Module):
        def forward(self, x):
            seen.append(torch.get_autocast_dtype("cuda"))
            return x

    wrapped = ReplicaAutocast(Probe(), torch.bfloat16)

    def replica():
        with torch.amp.autocast("cuda", enabled=True):  # as parallel_apply enters it
            Probe()(torch.zeros(1))
            wrapped(torch.zeros(1))

    thread = threading.Thread(target=replica)
    thread.start()
    thread.join()
    assert seen == [torch.float16, torch.bfloat16]


def test_one_process_on_several_gpus_wraps_its_replicas_in_the_runs_autocast(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    gpu = DistEnv(0, 1, 0, 1, torch.device("cuda", 0))
    model = nn.Linear(2, 2)
    with pytest.warns(UserWarning, match="using DataParallel"):
        wrapped = wrap(model, gpu, amp_dtype=torch.bfloat16, place=lambda m: m)
    assert isinstance(wrapped, nn.DataParallel) and wrapped.module.dtype == torch.bfloat16
    assert unwrap(wrapped) is model  # no prefix in checkpoints


def test_mean_and_std_normalise_the_batches_and_std_must_be_positive():
    # --mean and --std (or a timm model's published ones): uint8 255 -> (1 - 0.5) / 0.25
    p = Precision("cpu", mean=(0.5, 0.5, 0.5), std=(0.25, 0.25, 0.25))
    images = torch.full((1, 3, 2, 2), 255, dtype=torch.uint8)
    normalised = p.inputs(images, torch.device("cpu"))
    torch.testing.assert_close(normalised, torch.full((1, 3, 2, 2), 2.0))
    with pytest.raises(UserError, match="--std must be positive"):
        Config(std=(0.2, 0.0, 0.2))


def test_each_rank_of_a_node_compiles_into_a_cache_of_its_own(monkeypatch, tmp_path):
    from torch._inductor.runtime.cache_dir_utils import cache_dir, default_cache_dir

    from ddptrain.parallel.parallelize import own_compile_cache

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    own_compile_cache(3)
    assert cache_dir() == os.path.join(default_cache_dir(), "rank3")  # what inductor uses
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # the user's own: kept
    own_compile_cache(1)
    assert cache_dir() == str(tmp_path)
