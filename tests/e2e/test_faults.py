"""A rank that stalls must not stall the job: the others give up after --dist-timeout, and
their error names the stalled rank and where it was (the stall sits at its first data fetch)."""

import queue
import re
import subprocess
import threading
import time

import pytest
from cli import (
    ddptrain,
    env_with,
    kill_tree,
    tcp_pair,
    tcp_pair_started,
    tiny_args,
    torchrun,
    torchrun_command,
)

from ddptrain.distributed.phases import ABORT_GRACE, ORDER

# A healthy rank's wait for another must stay under TIMEOUT: with another test's ranks on the
# same 2 cores, a slow start could pass for a stall.
pytestmark = pytest.mark.serial
TIMEOUT = 10


def ends_in_time(run):
    start = time.monotonic()
    result = run()
    elapsed = time.monotonic() - start
    assert result.returncode != 0
    assert elapsed < TIMEOUT + 30, f"took {elapsed:.0f} s"
    return result


def test_a_stalled_rank_ends_the_job_under_torchrun(tiny_data, tmp_path):
    stall = {"DDPTRAIN_TEST_STALL_RANK": "1"}
    args = (*tiny_args(tiny_data, tmp_path), "--dist-timeout", TIMEOUT)
    result = ends_in_time(lambda: torchrun(2, "train", *args, env=stall))
    assert "ddptrain: error: lost contact with another rank" in result.stderr
    assert "; rank 1 was last in data fetch of global step 1 (" in result.stderr


def test_a_stalled_rank_ends_the_job_under_multiprocessing(tiny_data, tmp_path):
    stall = {"DDPTRAIN_TEST_STALL_RANK": "1"}
    args = (*tiny_args(tiny_data, tmp_path), "--dist-timeout", TIMEOUT)
    spawn = ("--multiprocessing-distributed", "--nproc-per-node", "2")
    result = ends_in_time(lambda: ddptrain("train", *args, *spawn, env=stall))
    assert "ddptrain: error: lost contact with another rank" in result.stderr
    assert "; rank 1 was last in data fetch of global step 1 (" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_stalled_rank_without_a_launcher_ends_with_the_one_that_failed(tiny_data, tmp_path):
    # Two invocations meeting at tcp://: no agent ends rank 1 when rank 0 gives up on it, and
    # rank 1 is stuck where no error reaches it (under NCCL, a collective is such a place).
    stall = {"DDPTRAIN_TEST_STALL_RANK": "1"}
    args = (*tiny_args(tiny_data, tmp_path), "--dist-timeout", TIMEOUT)
    start = time.monotonic()
    failed, stuck = tcp_pair("train", *args, env=stall, timeout=TIMEOUT + ABORT_GRACE + 60)
    assert time.monotonic() - start < TIMEOUT + ABORT_GRACE + 40
    assert "ddptrain: error: lost contact with another rank" in failed.stderr
    assert stuck.returncode == 1
    assert (
        "ddptrain: error: rank 0 failed (its own line says why), and rank 1, in data fetch of "
        f"global step 1, did not end with it within {ABORT_GRACE:.0f} s: ended now"
    ) in stuck.stderr


def frozen_at(point: str, rank: int, step: int) -> dict:
    """The environment that freezes global rank `rank` (SIGSTOP, as a host that hangs) at
    `point` of global step `step` (faults.py)."""
    return {"DDPTRAIN_TEST_KILL": f"{point}:{rank}:{step}", "DDPTRAIN_TEST_SIGNAL": "SIGSTOP"}


def first_error(job: subprocess.Popen, within: float) -> str:
    """The first `ddptrain: error:` line job writes to stderr, within `within` seconds (read on
    a thread: a silent job still meets the deadline)."""
    lines: queue.Queue = queue.Queue()
    threading.Thread(
        target=lambda: [*map(lines.put, job.stderr), lines.put(None)], daemon=True
    ).start()
    deadline = time.monotonic() + within
    while (left := deadline - time.monotonic()) > 0:
        try:
            line = lines.get(timeout=left)
        except queue.Empty:
            break
        if line is None:
            raise AssertionError(f"the job ended without an error line (exit {job.wait()})")
        if line.startswith("ddptrain: error:"):
            return line.strip()
    raise AssertionError(f"no error line within {within:.0f} s")


def test_a_frozen_rank_is_named_in_the_phase_the_others_wait_in(tiny_data, tmp_path):
    # Frozen in backward, rank 1 stands in the phase rank 0 waits in (DDP's all-reduce): only
    # the record's age tells them apart. bench/frozen_ranks.py freezes ranks at every point.
    args = (*tiny_args(tiny_data, tmp_path), "--dist-timeout", TIMEOUT, "-j", 1)
    job = subprocess.Popen(
        torchrun_command(2, "train", *args),
        stderr=subprocess.PIPE,
        text=True,
        env=env_with(**frozen_at("backward", 1, 2)),
    )
    try:
        line = first_error(job, TIMEOUT + 60)
    finally:
        kill_tree(job.pid)
    assert line.startswith("ddptrain: error: lost contact with another rank"), line
    # Where it was as last published, at most twice a second: up to the backward it froze in,
    # never past it (on a fast machine still setup's record, steps 1 and 2 both taken within
    # half a second).
    lost = r"\(a frozen process, or its host lost\)"
    said = re.search(
        rf"; rank 1 stopped answering \d+ s ago {lost}, last seen in (.*) of global step (\d+)$",
        line,
    )
    assert said and said[1] in (*ORDER[:5], "setup"), line
    position = (int(said[2]), ORDER.index(said[1]) if said[1] in ORDER else -1)
    assert position <= (2, ORDER.index("backward")), line


def test_a_frozen_rank_0_holding_the_store_is_named_by_the_others(tiny_data, tmp_path):
    args = ("train", *tiny_args(tiny_data, tmp_path), "--dist-timeout", TIMEOUT)
    rank0, rank1 = tcp_pair_started(*args, env=frozen_at("backward", 0, 2))
    try:
        _, stderr = rank1.communicate(timeout=TIMEOUT + 60)
    finally:
        kill_tree(rank0.pid)
        rank1.kill()
    assert rank1.returncode == 1, stderr
    assert (
        "rank 0, which hosts the rendezvous store, stopped answering (within 3 s): a frozen "
        "process, or its host lost"
    ) in stderr
