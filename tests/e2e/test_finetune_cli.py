"""Fine-tuning through the real CLI: a head-only first epoch (--freeze-backbone
--unfreeze-epoch 1) with layer decay and a faster head, resumed bitwise across the switch;
and the shipped recipe:finetune.

The tiny run of test_kills.py under torchrun on 2 ranks: 3 steps an epoch, 2 epochs, a
checkpoint every 2 steps and at each epoch's end, so step 2 is saved before the switch, step 3
at it and step 4 after it.
"""

import json
import tomllib
from importlib import resources

import pytest
from cli import assert_same_training, ddptrain, ok, resumable_args, tiny_args, torchrun
from test_user_errors import assert_user_error

from ddptrain.state.files import load

FINETUNE = (
    *("--freeze-backbone", "--unfreeze-epoch", 1, "--layer-decay", 0.7),
    *("--head-lr-scale", 10, "--lr", 0.01, "--grad-checkpointing", "--keep-last", 5),
)


def args(data, out, pretrained):
    return (*resumable_args(data, out), *FINETUNE, "--pretrained", pretrained)


@pytest.fixture(scope="module")
def pretrained(one_rank_run):
    return one_rank_run / "checkpoint.pt"


@pytest.fixture(scope="module")
def straight(tiny_data, tmp_path_factory, pretrained):
    out = tmp_path_factory.mktemp("finetune") / "run"
    ok(torchrun(2, *args(tiny_data, out, pretrained)))
    return out


@pytest.mark.parametrize(
    ("step", "resumed_at"),
    # killed in the head-only epoch / at the switch, resumed from the end of the head-only
    # epoch (whose optimizer state is the head's only) / in the first epoch of the whole model
    [(3, 2), (4, 3), (5, 4)],
)
def test_killed_before_or_after_unfreezing_resumes_bitwise(
    tiny_data, tmp_path, pretrained, straight, step, resumed_at
):
    out, marker = tmp_path / "run", tmp_path / "killed"
    kill = {"DDPTRAIN_TEST_KILL": f"between:1:{step}", "DDPTRAIN_TEST_KILL_ONCE": str(marker)}
    result = ok(torchrun(2, *args(tiny_data, out, pretrained), env=kill, restarts=2))
    assert marker.exists(), "the fault never fired"
    assert f"resumed from {out}/checkpoint-{resumed_at:09d}.pt" in result.stdout
    assert_same_training(straight, out)
    assert records(out) == records(straight)


SHARDED = ("--strategy", "fsdp", "--checkpoint-format", "sharded")


@pytest.fixture(scope="module")
def straight_sharded(tiny_data, tmp_path_factory, pretrained):
    out = tmp_path_factory.mktemp("finetune-sharded") / "run"
    ok(torchrun(2, *args(tiny_data, out, pretrained), *SHARDED))
    return out


def test_killed_at_the_switch_resumes_its_sharded_checkpoint_bitwise(
    tiny_data, tmp_path, pretrained, straight_sharded
):
    """The end of the head-only epoch, saved sharded: its missing backbone state is no
    damage, and the resumed run unfreezes as the uninterrupted one did."""
    out, marker = tmp_path / "run", tmp_path / "killed"
    kill = {"DDPTRAIN_TEST_KILL": "between:1:4", "DDPTRAIN_TEST_KILL_ONCE": str(marker)}
    result = ok(torchrun(2, *args(tiny_data, out, pretrained), *SHARDED, env=kill, restarts=2))
    assert marker.exists(), "the fault never fired"
    assert f"resumed from {out}/checkpoint-000000003.dcp" in result.stdout
    assert_same_training(straight_sharded, out)
    assert records(out) == records(straight_sharded)


def records(out_dir) -> list[dict]:
    lines = (out_dir / "metrics.jsonl").read_text().splitlines()
    return [
        {k: v for k, v in r.items() if "sec" not in k and "wait" not in k}
        for r in map(json.loads, lines)
    ]


def test_the_groups_lrs_are_recorded_by_layer(straight):
    first = next(r for r in records(straight) if r["split"] == "train")
    groups = {k.removeprefix("lr_"): v for k, v in first.items() if k.startswith("lr_")}
    assert first["lr"] == 0.01
    # resnet18: the stem, 8 blocks and the head (fc), 0.7 a layer down from the top
    assert list(groups) == [*(f"layer_{i}" for i in range(9)), "head"]
    assert groups["head"] == pytest.approx(0.1)
    for i in range(9):
        assert groups[f"layer_{i}"] == pytest.approx(0.01 * 0.7 ** (9 - i))


def test_the_first_epoch_trains_the_head_alone_and_the_second_all(straight, pretrained):
    start = load(pretrained)["model"]
    after_one, after_two = (
        load(straight / "checkpoint-000000003.pt"),
        load(straight / "checkpoint.pt"),
    )
    changed = {n for n, tensor in after_one["model"].items() if not tensor.equal(start[n])}
    # BatchNorm's statistics too: the backbone's norms stay in eval mode
    assert changed == {"fc.weight", "fc.bias"}
    assert len(after_one["optimizer"]["state"]) == 2  # the head's only
    changed = {n for n, tensor in after_two["model"].items() if not tensor.equal(start[n])}
    assert {"conv1.weight", "bn1.running_mean", "layer4.1.bn2.weight"} < changed
    assert len(after_two["optimizer"]["state"]) == 62  # every parameter of resnet18


def test_the_finetune_recipe_runs_and_sets_what_it_says(tiny_data, tmp_path, pretrained):
    """As shipped, but for a tiny model from a checkpoint of ours (no published weights here)
    and 3 epochs of the tiny set (its warmup takes 2)."""
    out = tmp_path / "run"
    given = ("-a", "resnet18", "--pretrained", pretrained)
    result = ok(
        ddptrain(
            "train",
            *tiny_args(tiny_data, out, "--epochs", 3),
            "--config",
            "recipe:finetune",
            *given,
        )
    )
    shown = "fine-tuning: head only for 1 epoch(s), then all, layer decay 0.85, head LR x10\n"
    assert shown in result.stdout
    recipe = tomllib.loads((resources.files("ddptrain") / "recipes" / "finetune.toml").read_text())
    assert recipe["pretrained"] is True and recipe["freeze-backbone"] is True
    written = json.loads((out / "config.json").read_text())
    for key, value in recipe.items():
        if key not in ("arch", "pretrained", "epochs", "batch-size"):  # given above
            expected = tuple(value) if isinstance(value, list) else value
            assert written[key.replace("-", "_")] == expected, key
    first = next(r for r in records(out) if r["split"] == "train")
    groups = {k.removeprefix("lr_"): v for k, v in first.items() if k.startswith("lr_")}
    assert groups["head"] == pytest.approx(10 * groups["layer_8"] / 0.85)
    assert groups["layer_0"] == pytest.approx(groups["layer_8"] * 0.85**8)
    checkpoint = load(out / "checkpoint.pt")
    assert checkpoint["epoch"] == 3 and len(checkpoint["optimizer"]["state"]) == 62


def test_drop_path_on_a_model_without_stochastic_depth_is_one_line(tiny_data, tmp_path):
    result = ddptrain("train", *tiny_args(tiny_data, tmp_path, "--drop-path", 0.1))
    assert_user_error(result, "--drop-path: torchvision's resnet18 has no stochastic depth")
