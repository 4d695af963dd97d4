"""The full recipe through the real CLI under torchrun: stopped mid-epoch and resumed, it ends
bitwise where the uninterrupted run does, its EMA included.

The tiny run of test_kills.py: 24 images, global batch 8, 3 steps an epoch, 2 epochs, a
checkpoint every 2 steps. Which of the model and its EMA scores best there depends on the CPU's
kernels: what model_best holds when the EMA wins is tested on a run built so that it must.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
from cli import (
    assert_same_training,
    assert_same_weights,
    ddptrain,
    ok,
    tiny_args,
    torchrun,
    training_state,
    val_records,
)
from test_user_errors import assert_user_error

from ddptrain.state import sharded
from ddptrain.state.files import load

RECIPE = (
    *("--lr-scheduler", "cosine", "--lr-warmup-epochs", "1", "--lr-min", "0.001"),
    *("--mixup-alpha", "0.2", "--cutmix-alpha", "1.0", "--label-smoothing", "0.1"),
    *("--model-ema", "--model-ema-steps", "1", "--model-ema-decay", "0.9"),
    *("--accum-steps", "2", "--clip-grad-norm", "5"),
)


def args(data, out):
    return (
        *("train", *tiny_args(data, out), "--resume", "auto", *RECIPE),
        *("--epochs", 2, "--checkpoint-every", 2),
    )


@pytest.fixture(scope="module")
def uninterrupted(tiny_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("recipe")
    ok(torchrun(2, *args(tiny_data, out)))
    assert training_state(out)["global_step"] == 6
    return out


def test_the_full_recipe_resumed_mid_epoch_is_bitwise_equal(tiny_data, tmp_path, uninterrupted):
    out, marker = tmp_path / "run", tmp_path / "killed"
    kill = {"DDPTRAIN_TEST_KILL": "between:1:5", "DDPTRAIN_TEST_KILL_ONCE": str(marker)}
    result = ok(torchrun(2, *args(tiny_data, out), env=kill, restarts=2))
    assert marker.exists(), "the fault never fired"
    assert f"resumed from {out}/checkpoint-000000004.pt" in result.stdout  # mid-epoch 2
    assert_same_training(uninterrupted, out)
    a, b = training_state(uninterrupted), training_state(out)
    # 6 steps, the EMA restarted at each of the 3 warmup steps: 1 + 3 updates
    assert a["model_ema"]["updates"] == b["model_ema"]["updates"] == 4
    for name, tensor in a["model_ema"]["model"].items():
        assert tensor.equal(b["model_ema"]["model"][name]), name
    assert ema_records(out) == ema_records(uninterrupted) and len(ema_records(out)) == 2
    # The last epoch's line says which of the two model_best.pt holds.
    which = {"model": "model", "model_ema": "ema"}[b["best_model"]]
    assert f"| best acc1 {b['best_acc1']:.2f} ({which})\n" in result.stdout


def ema_records(out_dir) -> list[dict]:
    lines = (out_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["split"] == "val_ema"]


def test_model_best_holds_the_better_of_the_model_and_its_average(
    tiny_data, tmp_path, uninterrupted
):
    # Whichever of the two the recipe's numerics favour (they differ between CPUs): the tests
    # below build a run whose EMA must win.
    best_path = uninterrupted / "model_best.pt"
    best = load(best_path)
    lines = (uninterrupted / "metrics.jsonl").read_text().splitlines()
    scores = [(r["acc1"], r["split"]) for r in map(json.loads, lines) if r["split"] != "train"]
    assert best["best_acc1"] == max(acc1 for acc1, _ in scores)
    winners = {"val": "model", "val_ema": "model_ema"}
    assert best["best_model"] in {winners[s] for acc1, s in scores if acc1 == best["best_acc1"]}
    assert ("weights" in best) == (best["best_model"] == "model_ema")
    # Evaluated on its own, the file scores what the run logged as the best.
    common = ("--image-size", 16, "-b", 8, "-j", 0, "--out-dir", tmp_path)
    ok(ddptrain("eval", tiny_data, *common, "--resume", best_path))
    (record,) = val_records(tmp_path)
    assert record["acc1"] == best["best_acc1"]


ARROW, CIRCLE = 0, 2  # tiny_data's class_to_idx: arrow, bar, circle


@pytest.fixture(scope="module")
def uneven_data(tiny_data, tmp_path_factory):
    """tiny_data with 1 of circle's 5 val images: val classes of 5, 5 and 1 images, so that a
    model that answers arrow to every image scores 5/11, one that answers circle 1/11."""
    out = Path(shutil.copytree(tiny_data, tmp_path_factory.mktemp("uneven") / "tiny"))
    for image in sorted((out / "val" / "circle").iterdir())[1:]:
        image.unlink()
    return out


def answering(weights: dict, label: int, logit: float) -> dict:
    """weights (resnet18's) with a classifier that ignores the image: fc's weight zero, so every
    logit is its bias, `logit` for label and 0 for the other classes."""
    bias = torch.zeros_like(weights["fc.bias"])
    bias[label] = logit
    return {**weights, "fc.weight": torch.zeros_like(weights["fc.weight"]), "fc.bias": bias}


@pytest.fixture(scope="module")
def ema_ahead(uneven_data, tmp_path_factory) -> Path:
    """A checkpoint of uneven_data after epoch 1 (global step 3) whose model answers circle to
    every image and whose EMA answers arrow, its best_acc1 0: what a run whose average
    outscores its weights would hold, made so whatever the CPU's kernels. Trained on at --lr 0,
    the model stays as it is (1/11) and the EMA answers arrow (5/11): its 3 updates keep over 4%
    of its arrow bias of 1e4 (the decay's ramp after 3 updates: 4/13, 5/14, 6/15), which
    outweighs the model's circle bias of 1."""
    out = tmp_path_factory.mktemp("ema-ahead")
    ema = ("--model-ema", "--model-ema-steps", 1, "--model-ema-decay", 0.9, "--amp", "none")
    ok(ddptrain("train", *tiny_args(uneven_data, out / "run"), *ema))
    checkpoint = torch.load(out / "run" / "checkpoint.pt", weights_only=True)
    assert checkpoint["global_step"] == 3 and checkpoint["class_to_idx"]["circle"] == CIRCLE
    checkpoint["model"] = answering(checkpoint["model"], CIRCLE, 1.0)
    average = checkpoint["model_ema"]
    average["model"] = answering(average["model"], ARROW, 1e4)
    torch.save({**checkpoint, "best_acc1": 0.0, "best_model": "model"}, out / "ema_ahead.pt")
    return out / "ema_ahead.pt"


# A sharded checkpoint on 2 ranks, each writing its shards; a single file on one process.
@pytest.mark.parametrize("form", ["full", "sharded"])
def test_model_best_holds_the_ema_when_it_scored_best(uneven_data, ema_ahead, tmp_path, form):
    out = tmp_path / "run"
    again = ("--resume", ema_ahead, "--epochs", 2, "--lr", 0, "--amp", "none")
    train = ("train", *tiny_args(uneven_data, out), *again, "--checkpoint-format", form)
    result = ok(torchrun(2, *train) if form == "sharded" else ddptrain(*train))
    # Cannot flip: fc's weight is 0 (kept at --lr 0), so logits are biases on any kernel/precision
    (val,), (val_ema,) = val_records(out), val_records(out, "val_ema")
    assert (val["acc1"], val_ema["acc1"]) == (pytest.approx(100 / 11), pytest.approx(500 / 11))
    assert "| best acc1 45.45 (ema)\n" in result.stdout
    best_path = out / ("model_best.dcp" if form == "sharded" else "model_best.pt")
    best = load(best_path)
    assert best["best_model"] == "model_ema" and best["weights"] == "model_ema"
    assert best["best_acc1"] == val_ema["acc1"]
    held = sharded.to_single(best_path) if form == "sharded" else best
    assert_same_weights(held["model"], training_state(out)["model_ema"]["model"])
    # Evaluated on its own, it scores the EMA's 5/11, not the model's 1/11.
    common = ("--image-size", 16, "-b", 8, "-j", 0, "--out-dir", tmp_path / "eval")
    ok(ddptrain("eval", uneven_data, *common, "--resume", best_path))
    (record,) = val_records(tmp_path / "eval")
    assert record["acc1"] == best["best_acc1"]
    again_args = tiny_args(uneven_data, tmp_path / "again", "--epochs", 3)
    refused = ddptrain("train", *again_args, "--resume", best_path)
    suffix = "dcp" if form == "sharded" else "pt"
    assert_user_error(refused, "holds the EMA of the weights", f"checkpoint-000000006.{suffix}")
