"""One run per out-dir: a second locker is refused naming the first; a dead one's lock is free."""

import errno
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap

import pytest

from ddptrain.errors import UserError
from ddptrain.state.lock import LOCK_FILE, lock_out_dir, unlock_out_dir

DEADLINE = 60


@pytest.fixture(autouse=True)
def _unlocked():
    yield
    unlock_out_dir()


def python(code: str, *args) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


TRY_LOCK = """
    import sys
    from pathlib import Path
    from ddptrain.state.lock import lock_out_dir
    try:
        lock_out_dir(Path(sys.argv[1]))
    except ValueError as err:
        sys.exit(f"refused: {err}")
    print("locked")
"""

# Locks, forks a child that lives on (as a DataLoader worker would), then waits to be killed.
LOCK_FORK_AND_WAIT = """
    import os, sys, time
    from pathlib import Path
    from ddptrain.state.lock import lock_out_dir
    lock_out_dir(Path(sys.argv[1]))
    child = os.fork()
    if child == 0:
        time.sleep(120)
        os._exit(0)
    print(child, flush=True)
    time.sleep(120)
"""


def try_lock(out_dir) -> subprocess.CompletedProcess:
    p = python(TRY_LOCK, out_dir)
    out, err = p.communicate(timeout=DEADLINE)
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def test_a_second_run_is_refused_naming_the_first_runs_host_and_pid(tmp_path):
    lock_out_dir(tmp_path)
    record = json.loads((tmp_path / LOCK_FILE).read_text())
    assert (record["host"], record["pid"]) == (socket.gethostname(), os.getpid())

    second = try_lock(tmp_path)
    assert second.returncode == 1, second.stderr
    assert f"--out-dir {tmp_path} is in use by another run " in second.stderr
    assert f"(host {socket.gethostname()}, pid {os.getpid()}, started " in second.stderr

    unlock_out_dir()
    assert not (tmp_path / LOCK_FILE).exists()  # the run that ends removes it
    assert try_lock(tmp_path).stdout == "locked\n"


def test_a_lock_file_removed_between_open_and_lock_is_not_the_one_taken(tmp_path, monkeypatch):
    """The previous holder ended (unlocked and removed the file) just after this run opened
    it: the lock on that orphan file must not count; the run takes the file at the path."""
    path = tmp_path / LOCK_FILE
    real_open = os.open

    def open_then_holder_ends(name, *args):
        fd = real_open(name, *args)
        if not hasattr(open_then_holder_ends, "done"):
            open_then_holder_ends.done = True
            os.unlink(name)  # as unlock_out_dir in the other run
        return fd

    monkeypatch.setattr(os, "open", open_then_holder_ends)
    lock_out_dir(tmp_path)
    monkeypatch.undo()
    assert json.loads(path.read_text())["pid"] == os.getpid()
    assert try_lock(tmp_path).returncode == 1  # a third run sees this lock


def test_the_lock_of_a_killed_run_is_taken_over_even_while_its_forked_child_lives(tmp_path):
    holder = python(LOCK_FORK_AND_WAIT, tmp_path)
    child = int(holder.stdout.readline())
    try:
        assert try_lock(tmp_path).returncode == 1  # held, by the parent
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=DEADLINE)
        os.kill(child, 0)  # the forked child is still alive...
        lock_out_dir(tmp_path)  # ...and did not keep the lock: the dead run's lock is gone
    finally:
        holder.kill()
        os.kill(child, signal.SIGKILL)
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()


def test_a_stale_or_garbled_lock_file_is_taken_over(tmp_path):
    (tmp_path / LOCK_FILE).write_text("not a record, and longer than the one that replaces it" * 9)
    lock_out_dir(tmp_path)
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()


def test_an_out_dir_that_cannot_be_made_is_a_user_error(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(UserError, match=f"--out-dir {tmp_path / 'file' / 'out'}: Not a directory"):
        lock_out_dir(tmp_path / "file" / "out")


def test_a_file_system_without_locks_is_a_warning_and_the_run_goes_on(tmp_path, monkeypatch):
    def refused(fd, operation):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", refused)
    warning = lock_out_dir(tmp_path)
    assert warning == (
        f"--out-dir {tmp_path}: cannot lock {tmp_path / LOCK_FILE} ({os.strerror(errno.ENOLCK)}); "
        "a second run in the same out-dir would not be refused"
    )
    assert lock_out_dir(tmp_path) is not None  # nothing held: a second call is no error
