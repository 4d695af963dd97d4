"""A rank that stalls must not stall the job: the others give up after --dist-timeout, and
their error names the stalled rank and where it was (the stall sits at its first data fetch)."""

import time

import pytest
from cli import ddptrain, tcp_pair, tiny_args, torchrun

from ddptrain.distributed.phases import ABORT_GRACE

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
