"""--strategy fsdp through the real CLI under torchrun: the same guarantees as ddp.

The tiny run of test_kills.py: 24 images, global batch 8, 3 steps an epoch, 2 epochs, a
checkpoint every 2 steps and at each epoch's end.
"""

import re
import shutil

import pytest
from cli import (
    assert_same_training,
    ddptrain,
    ok,
    tiny_args,
    torchrun,
    training_state,
    val_records,
)
from test_user_errors import assert_user_error, timed


def args(data, out, *extra):
    return (
        *("train", *tiny_args(data, out), "--resume", "auto", "--strategy", "fsdp"),
        *("--epochs", 2, "--checkpoint-every", 2, *extra),
    )


@pytest.fixture(scope="module")
def uninterrupted(tiny_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp")
    result = ok(torchrun(2, *args(tiny_data, out)))
    assert "fsdp" in result.stdout
    assert training_state(out)["global_step"] == 6
    return out


@pytest.mark.parametrize(("point", "rank", "step", "resumed_at"), [("data", 1, 5, 4)])
def test_a_killed_fsdp_rank_restarts_and_ends_bitwise_equal(
    tiny_data, tmp_path, uninterrupted, point, rank, step, resumed_at
):
    out, marker = tmp_path / "run", tmp_path / "killed"
    env = {"DDPTRAIN_TEST_KILL": f"{point}:{rank}:{step}", "DDPTRAIN_TEST_KILL_ONCE": str(marker)}
    result = ok(torchrun(2, *args(tiny_data, out), env=env, restarts=2))
    assert marker.exists(), "the fault never fired"
    assert f"resumed from {out}/checkpoint-{resumed_at:09d}.pt" in result.stdout
    assert_same_training(uninterrupted, out)


@pytest.fixture(scope="module")
def uninterrupted_sharded(tiny_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp-sharded")
    ok(torchrun(2, *args(tiny_data, out, *SHARDED)))
    assert training_state(out)["global_step"] == 6
    return out


SHARDED = ("--checkpoint-format", "sharded")


def test_a_killed_rank_restarts_from_its_sharded_checkpoint_bitwise_equal(
    tiny_data, tmp_path, uninterrupted_sharded
):
    out, marker = tmp_path / "run", tmp_path / "killed"
    env = {"DDPTRAIN_TEST_KILL": "data:1:5", "DDPTRAIN_TEST_KILL_ONCE": str(marker)}
    result = ok(torchrun(2, *args(tiny_data, out, *SHARDED), env=env, restarts=2))
    assert marker.exists(), "the fault never fired"
    assert f"resumed from {out}/checkpoint-000000004.dcp" in result.stdout
    assert_same_training(uninterrupted_sharded, out)
    assert not list(out.glob(".checkpoint-*"))  # no temp folder left by the killed save


def test_a_sharded_checkpoint_missing_a_shard_stops_every_rank(
    tiny_data, tmp_path, uninterrupted_sharded
):
    out = tmp_path / "run"
    shutil.copytree(uninterrupted_sharded, out, symlinks=True)
    for folder in out.glob("checkpoint-*.dcp"):
        (folder / "__1_0.distcp").unlink()
    result = timed(lambda: torchrun(2, *args(tiny_data, out, *SHARDED, "--epochs", 3)))
    # Both ranks' lines, in whichever order they reached the pipe (torchrun adds a traceback).
    assert_user_error(result, traceback_allowed=True)
    assert "ddptrain: error: --resume auto: no usable checkpoint" in result.stderr  # rank 0
    assert "ddptrain: error: another rank failed while setting up" in result.stderr  # rank 1
    skipped = "checkpoint-000000006.dcp is damaged: its shard __1_0.distcp is missing"
    assert f"warning: --resume auto skips a checkpoint: {out}/{skipped}" in result.stderr


def test_an_fsdp_checkpoint_evaluated_in_one_process_gives_the_logged_counts(
    tiny_data, tmp_path, uninterrupted
):
    # resnet18 has BatchNorm: the checkpoint holds the statistics the run evaluated with.
    logged = val_records(uninterrupted)[-1]
    result = ok(
        ddptrain(
            "eval", *tiny_args(tiny_data, tmp_path), "--resume", uninterrupted / "checkpoint.pt"
        )
    )
    assert f"acc1 {logged['acc1']:.2f} acc5 {logged['acc5']:.2f} ({logged['samples']} images)" in (
        result.stdout
    )
    evaluated = val_records(tmp_path)[-1]
    assert evaluated["samples"] == logged["samples"] == 15
    assert (evaluated["acc1"], evaluated["acc5"]) == (logged["acc1"], logged["acc5"])
    assert evaluated["loss"] == pytest.approx(logged["loss"], rel=1e-5)


def test_pretrained_weights_reach_every_fsdp_shard(tiny_data, tmp_path, uninterrupted):
    # Rank 1 builds its model without weights (on the meta device) and skips loading the file:
    # its shards hold rank 0's pretrained weights, or its half of the counts would differ.
    weights = tmp_path / "trained.safetensors"
    ok(ddptrain("export", uninterrupted / "checkpoint.pt", "--out", weights))
    logged = val_records(uninterrupted)[-1]
    evaluate = ("eval", *tiny_args(tiny_data, tmp_path / "eval"), "--pretrained", weights)
    result = ok(torchrun(2, *evaluate, "--strategy", "fsdp"))
    assert f"acc1 {logged['acc1']:.2f} acc5 {logged['acc5']:.2f} ({logged['samples']} images)" in (
        result.stdout
    )


def test_a_ddp_run_continues_under_fsdp(tiny_data, tmp_path):
    out = tmp_path / "run"
    ok(torchrun(2, "train", *tiny_args(tiny_data, out), "--checkpoint-every", 2))
    result = ok(torchrun(2, *args(tiny_data, out)))
    assert f"resumed from {out}/checkpoint-000000003.pt" in result.stdout
    assert training_state(out)["global_step"] == 6


def test_a_compiled_ddp_run_continues_compiled_under_fsdp(tiny_data, tmp_path):
    """--compile under both strategies: the saved --compile carries over, and fsdp's compiled
    units (shapes kept static, see compile_model) train as ddp's compiled graph does."""
    compiled_ddp, out = tmp_path / "ddp", tmp_path / "fsdp"
    ok(torchrun(2, "train", *tiny_args(tiny_data, compiled_ddp), "--epochs", 2, "--compile"))
    halfway = compiled_ddp / "checkpoint-000000003.pt"
    fsdp = ("--strategy", "fsdp", "--epochs", 2, "--resume", halfway)
    logs = {"TORCH_LOGS": "recompiles"}  # dynamo names each function it compiles again
    result = ok(torchrun(2, "train", *tiny_args(tiny_data, out), *fsdp, env=logs))
    assert f"resumed from {halfway}" in result.stdout
    assert "compile True" in result.stdout
    # A block's forward is compiled again for each width: the shard units run compiled, and
    # none of them reached the limit past which dynamo runs a function eager.
    assert re.search(r"Recompiling function forward in \S+resnet\.py", result.stderr)
    assert "recompile_limit" not in result.stderr
    ddp_epoch, fsdp_epoch = (val_records(run)[-1] for run in (compiled_ddp, out))
    assert fsdp_epoch["epoch"] == ddp_epoch["epoch"] == 2
    assert fsdp_epoch["acc1"] == ddp_epoch["acc1"]
    assert fsdp_epoch["loss"] == pytest.approx(ddp_epoch["loss"], rel=1e-5)


# An average that moves at every step; lr 0.001 and contiguous batches: ddp and fsdp then agree
# bitwise on 16 px images (channels_last's roundoff grows through BatchNorm on batches of 4).
EMA = ("--model-ema", "--model-ema-decay", 0.7, "--model-ema-steps", 1, "--lr", 0.001)
EMA += ("--no-channels-last",)


def test_an_fsdp_ema_is_ddp_s_and_restarts_bitwise_from_its_shards(tiny_data, tmp_path):
    """--model-ema under fsdp: the average's val records are ddp's; in the sharded format, a
    killed rank restarts from the EMA's shards and the run ends bitwise equal."""
    ddp, fsdp, killed = tmp_path / "ddp", tmp_path / "fsdp", tmp_path / "killed"
    ok(torchrun(2, *args(tiny_data, ddp, *EMA, "--strategy", "ddp")))
    ok(torchrun(2, *args(tiny_data, fsdp, *EMA, *SHARDED)))
    assert len(val_records(fsdp, "val_ema")) == 2
    assert val_records(fsdp, "val_ema") == val_records(ddp, "val_ema")
    assert training_state(fsdp)["model_ema"]["updates"] == 6

    marker = tmp_path / "kill-marker"
    env = {"DDPTRAIN_TEST_KILL": "data:1:5", "DDPTRAIN_TEST_KILL_ONCE": str(marker)}
    result = ok(torchrun(2, *args(tiny_data, killed, *EMA, *SHARDED), env=env, restarts=2))
    assert marker.exists(), "the fault never fired"
    assert f"resumed from {killed}/checkpoint-000000004.dcp" in result.stdout
    assert_same_training(fsdp, killed)


def test_fsdp_refuses_what_it_cannot_do(tiny_data, tmp_path):
    result = timed(lambda: ddptrain(*args(tiny_data, tmp_path / "x", "--strategy", "zero3")))
    assert_user_error(result, "--strategy must be one of ddp, fsdp")
    result = timed(lambda: ddptrain("train", *tiny_args(tiny_data, tmp_path), "--fsdp-offload"))
    assert_user_error(result, "--fsdp-offload goes with --strategy fsdp")
