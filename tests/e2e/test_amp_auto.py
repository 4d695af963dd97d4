"""--amp auto, the default: the start-up says what it chose and why, the choice is saved, and a
resumed run keeps it."""

import json

import torch
from cli import BF16_CROP, ddptrain, ok, tiny_args
from cli import training_state as state

from ddptrain.model.precision import auto_amp, bf16_units


def test_auto_is_shown_saved_resolved_and_kept_on_resume(tiny_data, tmp_path):
    # tiny_args gives --seed: on a CPU with bf16 units, auto keeps such a run in fp32
    expected, reason = auto_amp("cpu", bf16_units(torch.device("cpu")), bitwise=True)
    first = ok(ddptrain("train", *tiny_args(tiny_data, tmp_path)))
    assert f"amp {expected} ({reason})" in first.stdout
    assert json.loads((tmp_path / "config.json").read_text())["amp"] == expected  # not "auto"
    again = ok(
        ddptrain("train", *tiny_args(tiny_data, tmp_path), "--epochs", "2", "--resume", "auto")
    )
    assert f"amp {expected}," in again.stdout and "(auto:" not in again.stdout
    assert state(tmp_path)["config"]["amp"] == expected and state(tmp_path)["epoch"] == 2


def test_auto_without_a_seed_takes_what_the_cpu_computes_fastest(tiny_data, tmp_path):
    expected, reason = auto_amp("cpu", bf16_units(torch.device("cpu")))
    # bf16 where the CPU has it; --lr 0: without a seed the start differs each time, and the
    # test is about the choice, not whether this run's bf16 training stays finite
    args = tiny_args(tiny_data, tmp_path, "--image-size", BF16_CROP, "--lr", "0")
    del args[args.index("--seed") : args.index("--seed") + 2]
    result = ok(ddptrain("train", *args))
    assert f"amp {expected} ({reason})" in result.stdout
    assert state(tmp_path)["config"]["amp"] == expected
