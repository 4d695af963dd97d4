import csv
import json
import signal

import pytest
import torch
from cli import (
    BF16_CROP,
    assert_same_training,
    copy_run,
    ddptrain,
    env_with,
    ok,
    tiny_args,
    torchrun,
    val_records,
)
from cli import training_state as state
from test_user_errors import assert_user_error


def test_two_epochs_equal_one_then_resume_bitwise(tiny_data, tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    ok(ddptrain("train", *tiny_args(tiny_data, straight), "--epochs", "2"))
    ok(ddptrain("train", *tiny_args(tiny_data, resumed), "--epochs", "1"))
    result = ok(
        ddptrain("train", *tiny_args(tiny_data, resumed), "--epochs", "2", "--resume", "auto")
    )
    assert "resumed from" in result.stdout

    assert state(straight)["epoch"] == 2
    assert_same_training(straight, resumed)


def test_resume_auto_without_a_checkpoint_starts_fresh(tiny_data, tmp_path):
    result = ok(ddptrain("train", *tiny_args(tiny_data, tmp_path), "--resume", "auto"))
    assert "starting fresh" in result.stdout and state(tmp_path)["epoch"] == 1


def test_a_two_rank_checkpoint_resumes_on_one_rank(tiny_data, tmp_path, two_rank_run):
    checkpoint = two_rank_run / "checkpoint.pt"
    ok(
        ddptrain(
            "train",
            *tiny_args(tiny_data, tmp_path / "one"),
            "--epochs",
            "2",
            "--resume",
            checkpoint,
        )
    )
    assert state(tmp_path / "one")["epoch"] == 2
    assert len(val_records(tmp_path / "one")) == 1  # only epoch 2 ran here


def test_a_one_rank_checkpoint_resumes_on_two_ranks(tiny_data, tmp_path, one_rank_run):
    out = copy_run(one_rank_run, tmp_path / "run")
    ok(torchrun(2, "train", *tiny_args(tiny_data, out), "--epochs", "2", "--resume", "auto"))
    assert state(out)["epoch"] == 2


def test_resuming_a_finished_run_does_nothing(tiny_data, tmp_path, one_rank_run):
    out = copy_run(one_rank_run, tmp_path / "run")
    before = (out / "checkpoint.pt").read_bytes()
    result = ok(ddptrain("train", *tiny_args(tiny_data, out), "--resume", "auto"))
    assert "nothing to train" in result.stdout
    assert (out / "checkpoint.pt").read_bytes() == before


def test_resume_keeps_the_precision_of_the_run(tiny_data, tmp_path):
    # --lr 0: the test is about the precision kept, not whether bf16 training stays finite (on
    # some CPUs bf16 tipped this tiny run over the edge of divergence). 32 px: see BF16_CROP.
    args = (*tiny_args(tiny_data, tmp_path), "--lr", "0", "--image-size", BF16_CROP)
    ok(ddptrain("train", *args, "--amp", "bf16", "--no-channels-last"))
    ok(ddptrain("train", *args, "--epochs", "2", "--resume", "auto"))
    saved = state(tmp_path)["config"]
    assert (saved["amp"], saved["channels_last"], saved["compile"]) == ("bf16", False, False)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["amp"] == "bf16" and state(tmp_path)["epoch"] == 2


def test_loader_workers_do_not_change_the_result(tiny_data, tmp_path, one_rank_run):
    """Each sample's augmentation comes from its own seed, not from a worker's generator."""
    ok(ddptrain("train", *tiny_args(tiny_data, tmp_path / "j2"), "-j", "2"))
    assert_same_training(one_rank_run, tmp_path / "j2")  # tiny_args' -j 0


def test_an_earlier_checkpoint_of_the_out_dir_is_refused_while_later_ones_are_there(
    tiny_data, tmp_path
):
    """Going back there would leave them to outrank the run's own saves (numbered by global
    step) in --resume auto and in retention."""
    out = tmp_path / "run"
    ok(ddptrain("train", *tiny_args(tiny_data, out), "--epochs", 2, "--checkpoint-every", 1))
    before = sorted(p.name for p in out.iterdir())
    earlier = out / "checkpoint-000000005.pt"
    result = ddptrain("train", *tiny_args(tiny_data, out), "--epochs", 3, "--resume", earlier)
    assert_user_error(result, "holds later checkpoints of its run (checkpoint-000000006.pt)")
    assert "another --out-dir" in result.stderr and sorted(p.name for p in out.iterdir()) == before


def test_resume_auto_past_damaged_checkpoints_goes_on_from_the_one_it_found(tiny_data, tmp_path):
    """The damaged later ones are removed, or they would outrank its own saves: with
    --keep-last 1, retention kept the damaged one and deleted the save just made. And a
    mid-epoch checkpoint resumes without -b repeated, the epoch's record with the learning rate
    the epoch began with."""
    out, straight = tmp_path / "run", tmp_path / "straight"
    every_step = ("--epochs", 2, "--checkpoint-every", 1, "--lr-scheduler", "cosine")
    ok(ddptrain("train", *tiny_args(tiny_data, out), *every_step, "--keep-last", 3))  # 6 steps
    copy_run(out, straight)
    for step in (5, 6):
        damage(out / f"checkpoint-{step:09d}.pt")
    args = tiny_args(tiny_data, out)
    del args[args.index("-b") : args.index("-b") + 2]  # the checkpoint's batch, mid-epoch
    again = (*every_step, "--keep-last", 1, "--resume", "auto")
    killed = ddptrain("train", *args, *again, env=env_with(DDPTRAIN_TEST_KILL="between:0:6"))
    assert killed.returncode == -signal.SIGKILL, killed.stderr  # after saving step 5
    assert f"resumed from {out}/checkpoint-000000004.pt" in killed.stdout
    removed = "checkpoints of {} are removed: checkpoint-000000006.pt, checkpoint-000000005.pt"
    assert removed.format(out) in killed.stderr
    result = ok(ddptrain("train", *args, *again))
    assert f"resumed from {out}/checkpoint-000000005.pt" in result.stdout
    assert_same_training(straight, out)
    lrs = [[r["lr"] for r in val_records(run, "train")] for run in (straight, out)]
    assert lrs[0] == lrs[1] and lrs[0][0] != lrs[0][1]


def damage(checkpoint):
    """A flipped bit inside tensor data: the checksums tell, torch.load alone would not."""
    data = bytearray(checkpoint.read_bytes())
    data[len(data) // 2] ^= 0x10
    checkpoint.write_bytes(bytes(data))


def test_a_new_lr_given_on_resume_scales_the_schedule_under_way(tiny_data, tmp_path):
    straight, out = tmp_path / "straight", tmp_path / "run"
    run = ("--epochs", 2, "--lr-scheduler", "cosine", "--checkpoint-every", 1)
    ok(ddptrain("train", *tiny_args(tiny_data, straight), *run))
    killed = ddptrain(
        "train", *tiny_args(tiny_data, out), *run, env=env_with(DDPTRAIN_TEST_KILL="between:0:6")
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr  # mid-epoch 2, at step 5
    ok(ddptrain("train", *tiny_args(tiny_data, out), *run, "--resume", "auto", "--lr", 0.05))
    lrs = [[r["lr"] for r in val_records(o, "train")] for o in (straight, out)]
    # Epoch 2 began before the resume: its record too is at the new base, half the old.
    assert lrs[1][0] == lrs[0][0] and lrs[1][1] == pytest.approx(lrs[0][1] / 2, rel=1e-12)
    assert json.loads((out / "config.json").read_text())["lr"] == 0.05
    assert state(out)["optimizer"]["param_groups"][0]["initial_lr"] == 0.05


def test_model_ema_added_on_resume_starts_from_the_resumed_weights(tiny_data, tmp_path):
    # Until its first update (none within 3 steps here) the average is what it began from: the
    # resumed model, not the weights the model was built with.
    ok(ddptrain("train", *tiny_args(tiny_data, tmp_path)))
    ema = ("--model-ema", "--model-ema-steps", 32, "--resume", "auto")
    ok(ddptrain("train", *tiny_args(tiny_data, tmp_path), "--epochs", 2, *ema))
    resumed = torch.load(tmp_path / "checkpoint-000000003.pt", weights_only=True)["model"]
    average = state(tmp_path)["model_ema"]
    assert average["updates"] == 0 and average["model"].keys() == resumed.keys()
    assert all(torch.equal(average["model"][k], resumed[k]) for k in resumed)
    with open(tmp_path / "summary.csv", newline="") as f:
        one, two = csv.DictReader(f)  # the average's columns come with it, blank before
    assert one["val_ema_acc1"] == "" and float(two["val_ema_acc1"]) >= 0


def test_start_epoch_moves_the_global_step_with_the_schedule(tiny_data, tmp_path):
    ok(ddptrain("train", *tiny_args(tiny_data, tmp_path), "--start-epoch", 1, "--epochs", 2))
    (train,) = val_records(tmp_path, "train")
    assert (train["epoch"], train["global_step"]) == (2, 6)  # 3 steps an epoch
    assert (tmp_path / "checkpoint-000000006.pt").exists() and state(tmp_path)["global_step"] == 6


def test_a_resume_checks_the_checkpoints_batch_over_the_ranks_not_the_default(tiny_data, tmp_path):
    """Trained with -b 6, resumed on 3 ranks without -b: the divisibility check read the
    default 256 before the checkpoint's settings were merged, and refused."""
    out = tmp_path / "run"
    ok(ddptrain("train", *tiny_args(tiny_data, out), "-b", 6))
    flags = tiny_args(tiny_data, out)
    del flags[flags.index("-b") : flags.index("-b") + 2]
    ok(torchrun(3, "train", *flags, "--epochs", 2, "--resume", "auto"))
    assert state(out)["epoch"] == 2 and state(out)["config"]["batch_size"] == 6


def test_a_mid_epoch_checkpoint_is_evaluated_with_any_batch(tiny_data, tmp_path):
    """Evaluation continues no epoch: the mid-epoch position, which only a resume with the same
    global batch can continue, refused `eval -b 4` of a preempted run's newest checkpoint."""
    out = tmp_path / "run"
    ok(ddptrain("train", *tiny_args(tiny_data, out), "--checkpoint-every", 1))
    mid = out / "checkpoint-000000002.pt"
    assert torch.load(mid, weights_only=True)["epoch_step"] == 2
    result = ok(ddptrain("eval", tiny_data, "--resume", mid, "-b", 4, "-j", 0, "--out-dir", out))
    assert "val: loss" in result.stdout and "(15 images)" in result.stdout
    flags = tiny_args(tiny_data, tmp_path / "on")  # training on from it needs the same batch
    flags[flags.index("-b") + 1] = "4"
    refused = ddptrain("train", *flags, "--resume", mid)
    assert_user_error(refused, "the checkpoint stopped mid-epoch with global batch 8")


def test_a_flag_checked_against_a_setting_the_checkpoint_holds_meets_the_checkpoints(
    tiny_data, tmp_path
):
    """`eval --val-resize 20` of a 16 px run was refused against the default 224 px crop,
    before the checkpoint's --image-size came in."""
    out = tmp_path / "run"
    ok(ddptrain("train", *tiny_args(tiny_data, out)))
    args = ("eval", tiny_data, "--resume", out / "checkpoint.pt", "-j", 0, "--out-dir", out)
    result = ok(ddptrain(*args, "--val-resize", 20))
    assert "(15 images)" in result.stdout
    refused = ddptrain(*args, "--val-resize", 12)  # below the checkpoint's crop: still refused
    assert_user_error(refused, "--val-resize at least the crop; got crop 16, resize 12")
