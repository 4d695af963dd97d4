import json
import signal

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
    # At the default --lr 0.1 this tiny run sits at the edge of divergence, and on some CPUs
    # bf16 tips it over (non-finite weights end the run): the test is about precision. 32 px:
    # see BF16_CROP.
    args = (*tiny_args(tiny_data, tmp_path), "--lr", "0.01", "--image-size", BF16_CROP)
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


def test_resuming_an_earlier_checkpoint_of_the_out_dir_continues_from_it(tiny_data, tmp_path):
    """Its later checkpoints are of the run it went back from: once removed, they no longer
    outrank its own saves (numbered by global step) in --resume auto, or in retention. And a
    mid-epoch checkpoint resumes without -b repeated, the epoch's record with the learning
    rate the epoch began with."""
    out, straight = tmp_path / "run", tmp_path / "straight"
    every_step = ("--epochs", 2, "--checkpoint-every", 1, "--keep-last", 3)
    cosine = ("--lr-scheduler", "cosine")  # a learning rate that changes within an epoch
    ok(ddptrain("train", *tiny_args(tiny_data, out), *every_step, *cosine))  # 6 steps
    copy_run(out, straight)
    went_back = ddptrain(
        "train",
        *tiny_args(tiny_data, out),
        *every_step,
        *("--resume", out / "checkpoint-000000004.pt"),
        env=env_with(DDPTRAIN_TEST_KILL="between:0:6"),  # after saving step 5
    )
    assert went_back.returncode == -signal.SIGKILL, went_back.stderr
    removed = (
        "the later checkpoints of {} are removed: checkpoint-000000006.pt, checkpoint-000000005.pt"
    )
    assert removed.format(out) in went_back.stderr
    args = tiny_args(tiny_data, out)
    del args[args.index("-b") : args.index("-b") + 2]  # the checkpoint's batch, mid-epoch
    result = ok(ddptrain("train", *args, *every_step, "--resume", "auto"))
    assert f"resumed from {out}/checkpoint-000000005.pt" in result.stdout
    assert_same_training(straight, out)
    lrs = [[r["lr"] for r in val_records(run, "train")] for run in (straight, out)]
    assert lrs[0] == lrs[1] and lrs[0][0] != lrs[0][1]
