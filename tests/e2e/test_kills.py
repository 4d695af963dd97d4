"""Killed runs continue as if nothing had happened: the same weights, bit for bit.

The tiny run: 24 images, global batch 8, so 3 steps an epoch, 2 epochs; a checkpoint every 2
steps (global steps 2 and 4) and at each epoch's end (steps 3 and 6). Faults are injected with
DDPTRAIN_TEST_KILL=POINT:RANK:STEP (see ddptrain/faults.py); a marker file makes each fire once,
so the run torchrun restarts goes through.
"""

import re
import signal
import subprocess
import sys
import time

import pytest
import torch
from cli import (
    DEADLINE,
    assert_same_training,
    assert_same_weights,
    ddptrain,
    ended,
    env_with,
    kill_tree,
    ok,
    signal_tree,
    tiny_args,
    torchrun,
    torchrun_command,
    training_state,
    wait_pending,
    wait_stopped,
)
from cli import (
    resumable_args as args,
)

BEST = "model_best.pt"


def kill(point, rank, step, marker):
    return {"DDPTRAIN_TEST_KILL": f"{point}:{rank}:{step}", "DDPTRAIN_TEST_KILL_ONCE": str(marker)}


@pytest.mark.parametrize(
    ("point", "rank", "step", "resumed_at"),
    [
        ("data", 1, 5, 4),  # mid-epoch 2, resumes mid-epoch from step 4
        ("backward", 0, 3, 2),  # the last step of epoch 1, resumes mid-epoch from step 2
        ("between", 1, 4, 3),  # right after epoch 1's checkpoint
        ("before_rename", 0, 4, 3),  # the step-4 checkpoint written but not committed
        ("after_rename", 0, 4, 4),  # committed, checkpoint.pt not yet pointing at it
        ("after_rename", 0, 3, 3),  # epoch 1's committed, its best copy not yet in place
    ],
)
def test_a_rank_killed_under_torchrun_restarts_and_ends_bitwise_equal(
    tiny_data, tmp_path, uninterrupted, point, rank, step, resumed_at
):
    out, marker = tmp_path / "run", tmp_path / "killed"
    env = kill(point, rank, step, marker)
    result = ok(torchrun(2, *args(tiny_data, out), env=env, restarts=2))
    assert marker.exists(), "the fault never fired"
    assert f"resumed from {out}/checkpoint-{resumed_at:09d}.pt" in result.stdout
    assert not list(out.glob(".checkpoint*")), "a temp file of the killed save was left"
    assert not list(out.glob(".model_best*")), "a best copy of the killed save was left"
    assert_same_training(uninterrupted, out)
    best, expected = (torch.load(r / BEST, weights_only=True) for r in (out, uninterrupted))
    assert best["global_step"] == expected["global_step"]
    assert_same_weights(best["model"], expected["model"])


def test_three_ranks_killed_and_restarted_end_bitwise_equal(tiny_data, tmp_path):
    """On 3 ranks the all-reduce's sums follow DDP's bucket layout, which DDP re-lays after its
    first backward: a restarted process must reduce its first step as the uninterrupted one
    did (parallel/parallelize.py, lay_out_buckets). Before, weights differed by up to 66%."""
    three = ("-b", 6)  # 2 images a rank, 4 steps an epoch
    straight, out = tmp_path / "straight", tmp_path / "run"
    ok(torchrun(3, *args(tiny_data, straight), *three))
    env = kill("data", 1, 7, tmp_path / "killed")
    result = ok(torchrun(3, *args(tiny_data, out), *three, env=env, restarts=2))
    assert f"resumed from {out}/checkpoint-000000006.pt" in result.stdout  # mid-epoch 2
    assert_same_training(straight, out)


def test_the_whole_job_killed_and_relaunched_ends_bitwise_equal(tiny_data, tmp_path, uninterrupted):
    out = tmp_path / "run"
    # Every process of the job dies at once, as when a node goes away, right after step 4's
    # checkpoint is committed (stall rank 0 there so the kill lands in a known place). The
    # workers too: a stopped rank 0 left alive would still hold the out-dir's lock.
    job = subprocess.Popen(
        torchrun_command(2, *args(tiny_data, out)),
        env=env_with(
            **kill("after_rename", 0, 4, tmp_path / "marker"), DDPTRAIN_TEST_SIGNAL="SIGSTOP"
        ),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + DEADLINE
        while not (tmp_path / "marker").exists() and job.poll() is None:
            assert time.monotonic() < deadline, "the job never reached step 4"
            time.sleep(0.2)
    finally:
        kill_tree(job.pid)
        job.wait(timeout=60)
    assert training_state(out)["global_step"] == 3  # checkpoint.pt was not yet moved on
    result = ok(torchrun(2, *args(tiny_data, out)))
    assert f"resumed from {out}/checkpoint-000000004.pt" in result.stdout
    assert_same_training(uninterrupted, out)


def test_a_damaged_newest_checkpoint_is_skipped_for_the_previous_one(
    tiny_data, tmp_path, uninterrupted
):
    out = tmp_path / "run"
    ok(torchrun(2, *args(tiny_data, out, epochs=1)))
    newest = out / "checkpoint-000000003.pt"
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0x10  # inside tensor data: torch.load alone would not notice
    newest.write_bytes(bytes(data))
    result = ok(torchrun(2, *args(tiny_data, out)))
    assert f"skips a checkpoint: {newest} is damaged" in result.stderr
    assert f"resumed from {out}/checkpoint-000000002.pt" in result.stdout
    assert_same_training(uninterrupted, out)


def test_sigterm_stops_every_rank_with_a_checkpoint_then_resume_ends_bitwise_equal(
    tiny_data, tmp_path, uninterrupted
):
    out = tmp_path / "run"
    # SIGTERM reaches rank 1 only, before step 2; the agreement read then started before the
    # signal, the one read before step 3 says stop: every rank saves after step 2 and exits.
    env = {"DDPTRAIN_TEST_KILL": "between:1:2", "DDPTRAIN_TEST_SIGNAL": "SIGTERM"}
    stopped = torchrun(2, *args(tiny_data, out, checkpoint_every=0), env=env)
    assert stopped.returncode == 0, stopped.stderr  # a stop that saved is not a failure
    assert "ddptrain: stopped by SIGTERM after global step 2" in stopped.stderr
    assert training_state(out)["epoch_step"] == 2
    ok(torchrun(2, *args(tiny_data, out)))
    assert_same_training(uninterrupted, out)


def test_a_stop_signal_exits_0_once_saved(tiny_data, tmp_path):
    env = {"DDPTRAIN_TEST_KILL": "between:0:2", "DDPTRAIN_TEST_SIGNAL": "SIGUSR1"}
    result = ddptrain(*args(tiny_data, tmp_path, checkpoint_every=0), env=env)
    assert result.returncode == 0, result.stderr
    assert "ddptrain: stopped by SIGUSR1 after global step 1" in result.stderr
    assert training_state(tmp_path)["epoch_step"] == 1  # one process stops at once, before step 2
    assert "continue with --resume auto" in result.stderr


def test_a_stop_signal_with_nothing_to_save_leaves_every_file_as_it_was(tiny_data, tmp_path):
    ok(ddptrain(*args(tiny_data, tmp_path, epochs=1)))
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    env = {"DDPTRAIN_TEST_KILL": "between:0:4", "DDPTRAIN_TEST_SIGNAL": "SIGTERM"}
    result = ddptrain(*args(tiny_data, tmp_path), env=env)  # signalled before its first step
    assert result.returncode == 0, result.stderr
    assert "stopped by SIGTERM after global step 3" in result.stderr
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


@pytest.mark.serial  # timed: together takes seconds, a rank left waiting 600
def test_a_signal_to_one_rank_just_after_a_checkpoint_stops_both_together(tiny_data, tmp_path):
    # Rank 1 is signalled right after epoch 1's checkpoint (global step 3), with nothing
    # unsaved: it does not exit alone; both ranks agree at the next boundary, after step 4,
    # save it, and exit together.
    out = tmp_path / "run"
    env = {"DDPTRAIN_TEST_KILL": "between:1:4", "DDPTRAIN_TEST_SIGNAL": "SIGTERM"}
    started = time.monotonic()
    result = torchrun(2, *args(tiny_data, out, checkpoint_every=0), env=env)
    assert time.monotonic() - started < 60
    assert result.returncode == 0, result.stderr  # torchrun: every rank exited 0
    assert result.stderr.count("ddptrain: stopped by SIGTERM after global step 4") == 2
    assert "lost contact" not in result.stderr
    assert training_state(out)["global_step"] == 4


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_to_the_spawning_process_reaches_every_rank(tiny_data, tmp_path, signum):
    """`docker stop` and Kubernetes signal PID 1 alone: under --multiprocessing-distributed the
    parent, which SIGTERM killed, its ranks interrupted without the stop's checkpoint; a
    `kill -INT` ended its wait while the ranks trained on."""
    out = tmp_path / "run"
    spawn = ("--multiprocessing-distributed", "--nproc-per-node", 2, "--no-accel")
    command = [sys.executable, "-m", "ddptrain", "train", *tiny_args(tiny_data, out)]
    job = subprocess.Popen(
        [*command, *map(str, (*spawn, "--epochs", 100)), "--progress", "none"],
        env=env_with(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # the signal reaches the parent alone, not its group
        # As from a terminal: a suite run as a script's background job ignores SIGINT (so
        # does everything it starts), and a job that ignores it from the start keeps doing so.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        deadline = time.monotonic() + DEADLINE
        while not (out / "checkpoint-000000003.pt").exists():  # epoch 1 done
            assert job.poll() is None and time.monotonic() < deadline, job.communicate()
            time.sleep(0.2)
        job.send_signal(signum)
        stdout, stderr = ended(job)
    finally:
        kill_tree(job.pid)
    if signum == signal.SIGTERM:  # every rank stops at one step, saved
        assert job.returncode == 0, stderr
        stopped = re.search(r"ddptrain: stopped by SIGTERM after global step (\d+)", stderr)
        assert stopped, stderr
        assert training_state(out)["global_step"] == int(stopped[1])
    else:
        assert job.returncode == 130, stderr
        assert "ddptrain: interrupted" in stderr
    assert training_state(out)["epoch"] < 100


@pytest.mark.parametrize(
    ("point", "step", "stops_after"),
    [
        ("between", 5, 5),  # mid-epoch 2: agreed at the next boundary
        ("evaluation", 3, 4),  # epoch 1's evaluation: saved, then one step of epoch 2
        ("before_rename", 4, 5),  # writing step 4's checkpoint
    ],
    ids=["mid-epoch", "evaluation", "checkpoint-write"],
)
def test_sigterm_to_every_process_with_loader_workers_stops_the_job_saved(
    tiny_data, tmp_path, uninterrupted, point, step, stops_after
):
    """SLURM signals every process of a job step, loader workers included: the workers leave
    it to their rank, which stops with the others at one step, saved, and no rank crashes on
    "DataLoader worker ... is killed by signal: Terminated"."""
    job, out = _stopped_at(tiny_data, tmp_path, point, step)
    try:
        stalled = wait_stopped(job)  # rank 0, at the point
        signal_tree(job.pid, signal.SIGTERM)
        wait_pending(stalled, signal.SIGTERM)
        signal_tree(job.pid, signal.SIGCONT)
        _, stderr = ended(job)
    finally:
        kill_tree(job.pid)
    _assert_stopped_then_resumed(tiny_data, out, uninterrupted, stderr, stops_after)


def test_sigterm_to_torchrun_with_loader_workers_stops_the_job_saved(
    tiny_data, tmp_path, uninterrupted
):
    """torchrun passes a SIGTERM on to each worker's process group: loader workers included.
    torchrun itself then exits 1 (its SignalException); the ranks exit 0."""
    job, out = _stopped_at(tiny_data, tmp_path, "between", 5)
    try:
        stalled = wait_stopped(job)
        job.send_signal(signal.SIGTERM)
        wait_pending(stalled, signal.SIGTERM)
        signal_tree(job.pid, signal.SIGCONT)
        _, stderr = ended(job)
    finally:
        kill_tree(job.pid)
    _assert_stopped_then_resumed(tiny_data, out, uninterrupted, stderr, 5)


def _stopped_at(tiny_data, tmp_path, point: str, step: int):
    """A 2-rank torchrun job with a loader worker per rank, whose rank 0 stops itself
    (SIGSTOP) at point of global step: a signal sent now lands there."""
    out = tmp_path / "run"
    env = {**kill(point, 0, step, tmp_path / "marker"), "DDPTRAIN_TEST_SIGNAL": "SIGSTOP"}
    job = subprocess.Popen(
        torchrun_command(2, *args(tiny_data, out), "-j", 1),
        env=env_with(**env),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    return job, out


def _assert_stopped_then_resumed(tiny_data, out, uninterrupted, stderr: str, step: int) -> None:
    assert stderr.count(f"ddptrain: stopped by SIGTERM after global step {step} ") == 2, stderr
    assert "DataLoader worker" not in stderr
    assert training_state(out)["global_step"] == step
    ok(torchrun(2, *args(tiny_data, out), "-j", 1))
    assert_same_training(uninterrupted, out)
