"""A rank that stalls must not stall the job: the others give up after --dist-timeout, and
their error names the stalled rank and where it was (the stall sits at its first data fetch)."""

import time

from cli import ddptrain, tiny_args, torchrun

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
