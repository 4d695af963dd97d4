"""One run per out-dir: a second run in a live run's out-dir is refused at once, naming it; the
lock of a dead run, or of a torchrun attempt that died, is taken over."""

import json
import signal
import subprocess
import sys
import time

from cli import DEADLINE, copy_run, ddptrain, env_with, ok, tiny_args, torchrun

NO_WAIT = 60  # far below any wait on the first run, which never ends by itself


def stalled_holding_the_lock(data, out, stall: str, output=subprocess.DEVNULL) -> subprocess.Popen:
    """A run of one process that stalls where DDPTRAIN_TEST_STALL_RANK=stall says, once it has
    taken out's lock (killed if it never does)."""
    job = subprocess.Popen(
        [sys.executable, "-m", "ddptrain", "train", *map(str, tiny_args(data, out))],
        env=env_with(DDPTRAIN_TEST_STALL_RANK=stall),
        stdout=output,
        stderr=output,
        text=True,
    )
    lock, deadline = out / ".lock", time.monotonic() + DEADLINE
    try:
        while not (lock.exists() and lock.read_text()):
            assert job.poll() is None and time.monotonic() < deadline, "no lock taken"
            time.sleep(0.2)
    except BaseException:
        job.kill()
        job.wait(timeout=DEADLINE)
        raise
    return job


def test_a_second_run_in_a_live_runs_out_dir_fails_naming_it(tiny_data, tmp_path):
    out = tmp_path / "run"
    # The first run takes the lock in setup, then stalls before its first step.
    first = stalled_holding_the_lock(tiny_data, out, "0")
    try:
        assert json.loads((out / ".lock").read_text())["pid"] == first.pid

        second = ddptrain("train", *tiny_args(tiny_data, out), "--resume", "auto", timeout=NO_WAIT)
        assert second.returncode == 2, second.stderr
        errors = [e for e in second.stderr.splitlines() if e.startswith("ddptrain: error:")]
        assert len(errors) == 1 and "Traceback" not in second.stderr, second.stderr
        assert f"--out-dir {out} is in use by another run (host " in errors[0]
        assert f", pid {first.pid}, started " in errors[0]
    finally:
        first.kill()
        first.wait(timeout=DEADLINE)

    # Killed, it left its lock file behind but no lock.
    assert (out / ".lock").exists()
    ok(ddptrain("train", *tiny_args(tiny_data, out)))
    assert not (out / ".lock").exists()  # removed by the run that ended


def test_evaluate_takes_no_lock(tiny_data, tmp_path, one_rank_run):
    out = copy_run(one_rank_run, tmp_path / "run")
    (out / ".lock").write_text("")
    before = (out / ".lock").stat()
    ok(ddptrain("eval", *tiny_args(tiny_data, out), "--resume", out / "checkpoint.pt"))
    assert (out / ".lock").stat().st_mtime_ns == before.st_mtime_ns  # neither taken nor removed


def test_a_torchrun_restart_after_rank_0_died_is_not_refused(tiny_data, tmp_path):
    out, marker = tmp_path / "run", tmp_path / "killed"
    # Rank 0 dies holding the lock, its loader worker (-j 1) forked from it still alive.
    kill = {"DDPTRAIN_TEST_KILL": "between:0:3", "DDPTRAIN_TEST_KILL_ONCE": str(marker)}
    args = ("train", *tiny_args(tiny_data, out), "-j", 1, "--checkpoint-every", 1)
    result = ok(torchrun(2, *args, "--resume", "auto", env=kill, restarts=1))
    assert marker.exists(), "the fault never fired"
    assert f"resumed from {out}/checkpoint-000000002.pt" in result.stdout
    assert "in use by another run" not in result.stderr


def test_a_stop_signal_while_setting_up_ends_the_run_with_its_line(tiny_data, tmp_path):
    """Before the first step's handlers were installed, SIGTERM's default action killed a rank
    listing its data or building its model without a word, and told no other rank."""
    out = tmp_path / "run"
    job = stalled_holding_the_lock(tiny_data, out, "0:setup", output=subprocess.PIPE)
    try:  # the lock is taken just before the stall
        job.send_signal(signal.SIGTERM)
        _, stderr = job.communicate(timeout=DEADLINE)
    finally:
        job.kill()
        job.wait(timeout=DEADLINE)
    assert job.returncode == 128 + signal.SIGTERM, stderr
    assert "ddptrain: stopped by SIGTERM: nothing trained since the last checkpoint" in stderr
    assert not (out / "checkpoint.pt").exists()
