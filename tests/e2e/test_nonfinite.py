"""A loss that turns NaN or inf, on 2 ranks under torchrun: every rank agrees, no non-finite
checkpoint is ever written, and --nonfinite skip drops the bad step on every rank."""

import csv
import json

from cli import ddptrain, ok, tiny_args, torchrun, training_state
from test_user_errors import assert_user_error

from ddptrain.state.files import load, numbered, weights_finite


def train_records(out_dir) -> list[dict]:
    lines = (out_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["split"] == "train"]


def test_a_learning_rate_that_blows_up_stops_every_rank(tiny_data, tmp_path):
    # Step 1's update with lr 1e30 leaves huge but finite weights; step 2's loss is not finite.
    args = ("train", *tiny_args(tiny_data, tmp_path), "--lr", "1e30", "--epochs", 2)
    result = torchrun(2, *args, "--checkpoint-every", 1, "--resume", "auto")
    needles = ("became non-finite", "global step 2", "checkpoint-000000001.pt")
    assert_user_error(result, *needles, traceback_allowed=True)  # torchrun's own summary
    errors = [line for line in result.stderr.splitlines() if "ddptrain: error:" in line]
    assert len(errors) == 2 and errors[0] == errors[1]  # both ranks, the same step
    assert [p.name for p in numbered(tmp_path)] == ["checkpoint-000000001.pt"]
    assert weights_finite(load(tmp_path / "checkpoint-000000001.pt"))
    assert not (tmp_path / "metrics.jsonl").exists()  # no epoch record of NaN


def test_a_non_finite_gradient_with_a_finite_loss_stops_at_its_own_step(tiny_data, tmp_path):
    # Rank 1's gradient at step 2 is NaN, its loss is not: without the gradient check, step 2
    # would write NaN weights and only the save (or step 3's loss) would notice.
    poisoned = {"DDPTRAIN_TEST_NAN_GRAD": "1:2"}
    args = ("train", *tiny_args(tiny_data, tmp_path), "--checkpoint-every", 1)
    result = torchrun(2, *args, env=poisoned)
    needles = ("loss or its gradients became non-finite", "global step 2", "000000001.pt")
    assert_user_error(result, *needles, traceback_allowed=True)  # torchrun's own summary
    errors = [line for line in result.stderr.splitlines() if "ddptrain: error:" in line]
    assert len(errors) == 2 and errors[0] == errors[1]
    assert [p.name for p in numbered(tmp_path)] == ["checkpoint-000000001.pt"]


def test_skip_drops_a_step_whose_gradient_alone_is_not_finite(tiny_data, tmp_path):
    poisoned = {"DDPTRAIN_TEST_NAN_GRAD": "0:3"}
    args = ("train", *tiny_args(tiny_data, tmp_path), "--epochs", 2, "--nonfinite", "skip")
    ok(torchrun(2, *args, env=poisoned))
    assert [r["skipped"] for r in train_records(tmp_path)] == [1, 0]
    assert weights_finite(training_state(tmp_path))


def test_skip_drops_the_bad_step_on_every_rank_and_goes_on(tiny_data, tmp_path):
    poisoned = {"DDPTRAIN_TEST_NAN": "1:2"}  # rank 1's batch at step 2 only
    args = ("train", *tiny_args(tiny_data, tmp_path), "--epochs", 2, "--nonfinite", "skip")
    result = ok(torchrun(2, *args, "--model-ema", "--model-ema-steps", 1, env=poisoned))
    assert "ddptrain: error" not in result.stderr
    assert [r["skipped"] for r in train_records(tmp_path)] == [1, 0]
    assert train_records(tmp_path)[0]["samples"] == 16  # the skipped step's 8 left out
    state = training_state(tmp_path)
    assert state["global_step"] == 6 and weights_finite(state)
    assert state["model_ema"]["updates"] == 5  # the EMA skipped the dropped step too


def test_skip_puts_back_the_batchnorm_statistics_a_bad_batch_moved(tiny_data, tmp_path):
    # The forward of a NaN batch makes the running statistics NaN before the step is dropped:
    # left so, the epoch's checkpoint holds non-finite weights and the run fails at its save.
    poisoned = {"DDPTRAIN_TEST_NAN": "0:2"}
    args = ("train", *tiny_args(tiny_data, tmp_path), "--nonfinite", "skip")
    ok(ddptrain(*args, env=poisoned))
    assert [r["skipped"] for r in train_records(tmp_path)] == [1]
    assert weights_finite(training_state(tmp_path))


def test_an_epoch_whose_steps_were_all_skipped_has_no_means(tiny_data, tmp_path):
    # Its sums hold no sample: a loss of 0 and an accuracy of 0 would be a perfect loss and a
    # worthless model, where there is no measurement at all.
    poisoned = {"DDPTRAIN_TEST_NAN": "0:1,2,3"}  # each step of the first epoch
    args = ("train", *tiny_args(tiny_data, tmp_path), "--epochs", 2, "--nonfinite", "skip")
    result = ok(ddptrain(*args, "--progress", "lines", env=poisoned))
    assert "lr_scheduler.step()" not in result.stderr  # torch's warning: the first steps dropped
    first, second = train_records(tmp_path)
    assert (first["skipped"], first["samples"]) == (3, 0)
    assert first["loss"] is first["acc1"] is first["acc5"] is None  # null in metrics.jsonl
    assert second["skipped"] == 0 and second["samples"] == 24 and second["loss"] > 0
    assert "[3/3] loss - acc1      - acc5      - |" in result.stdout
    assert "epoch 1/2 done: train loss - acc1 - (" in result.stdout
    assert "samples/s) (3 steps skipped) | val loss" in result.stdout
    with open(tmp_path / "summary.csv") as f:
        rows = list(csv.DictReader(f))
    assert rows[0]["train_loss"] == "" and float(rows[1]["train_loss"]) > 0


def test_skip_under_powersgd_trains_on_after_the_dropped_step(tiny_data, tmp_path):
    # PowerSGD's error feedback took in the NaN gradient: kept, it made every later step NaN.
    poisoned = {"DDPTRAIN_TEST_NAN_GRAD": "0:3"}
    hook = ("--ddp-comm-hook", "powersgd", "--powersgd-start-step", 2)
    args = ("train", *tiny_args(tiny_data, tmp_path), "--epochs", 3, "--nonfinite", "skip")
    ok(torchrun(2, *args, *hook, env=poisoned))
    assert [r["skipped"] for r in train_records(tmp_path)] == [1, 0, 0]
    assert weights_finite(training_state(tmp_path))


def test_skip_stops_after_max_skipped(tiny_data, tmp_path):
    args = ("train", *tiny_args(tiny_data, tmp_path), "--lr", "1e30", "--nonfinite", "skip")
    result = torchrun(2, *args, "--max-skipped", 2)
    needle = "--nonfinite skip: 2 steps had non-finite gradients"
    assert_user_error(result, needle, traceback_allowed=True)  # torchrun's own summary
