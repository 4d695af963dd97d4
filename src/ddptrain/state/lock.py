"""One run per out-dir: the main rank holds an exclusive flock on OUT_DIR/.lock for the run's life.

Two runs writing one out-dir would replace each other's checkpoints and interleave their
metrics. The lock file records its holder's host and pid, so a second run fails at once naming
them; the run that ends removes it. The kernel releases a flock when its holder's file is
closed, at the latest when the process dies, however it dies: a crashed run leaves the file but
no lock, and the next run takes it over; the attempt torchrun restarts finds the dead attempt's
lock gone with it.

A flock belongs to the open file, which forked children (DataLoader workers) share: a worker
that outlived a killed rank 0 for a few seconds would still hold the lock and refuse the
restarted attempt. So every child closes its copy as soon as it is forked.

flock works across the clients of an NFS mount (Linux emulates it with NFS byte-range locks);
on a file system without locks, the run warns and goes on unlocked.
"""

import contextlib
import fcntl
import json
import os
import socket
import time
from pathlib import Path

from ddptrain.errors import UserError

LOCK_FILE = ".lock"

_held: tuple[int, Path] | None = None  # this process's lock: descriptor and path


def _close_in_child() -> None:
    global _held
    if _held is not None:
        os.close(_held[0])  # the parent's lock stays: it ends when the parent's copy closes
        _held = None


os.register_at_fork(after_in_child=_close_in_child)


def lock_out_dir(out_dir: Path) -> str | None:
    """Locks out_dir (creating it) for this process, or raises UserError naming the run that
    holds it. Returns a warning where the file system has no locks, else None. Call on the main
    rank only, before anything is written; unlock_out_dir() ends it."""
    global _held
    assert _held is None, "this process already holds a run lock"
    path = out_dir / LOCK_FILE
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UserError(f"--out-dir {out_dir}: {err.strerror}") from None
    try:
        fd = _lock(path, out_dir)
    except _NoLocks as err:
        return (
            f"--out-dir {out_dir}: cannot lock {path} ({err}); a second run in the same "
            "out-dir would not be refused"
        )
    _held = (fd, path)
    record = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}
    with contextlib.suppress(OSError):  # a full disk: the lock holds, only the record is lost
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)


class _NoLocks(Exception):
    """The file system refuses locks."""


def _lock(path: Path, out_dir: Path) -> int:
    """The descriptor of path, locked; raises _NoLocks where the file system has no locks."""
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as err:
            raise UserError(f"--out-dir {out_dir}: {err.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise UserError(
                f"--out-dir {out_dir} is in use by another run ({holder}): wait for it to end, "
                "or choose another --out-dir"
            ) from None
        except OSError as err:  # no locks on this file system (some FUSE mounts)
            os.close(fd)
            raise _NoLocks(err.strerror) from None
        if _is_at(fd, path):
            return fd
        # The run that held it removed it between our open and our lock: ours is a lock on a
        # file nobody else will open. Take the one at the path.
        os.close(fd)


def _is_at(fd: int, path: Path) -> bool:
    try:
        opened, named = os.fstat(fd), os.stat(path)
    except FileNotFoundError:
        return False
    return (opened.st_dev, opened.st_ino) == (named.st_dev, named.st_ino)


def unlock_out_dir() -> None:
    """Ends this process's lock, if it holds one, and removes the lock file: removed while still
    locked, so that a run which opened it meanwhile sees it gone and takes a new one."""
    global _held
    if _held is not None:
        (fd, path), _held = _held, None
        with contextlib.suppress(OSError):
            path.unlink()
        os.close(fd)


def _holder(fd: int) -> str:
    try:
        record = json.loads(os.pread(fd, 4096, 0))
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(record["started"])))
        return f"host {record['host']}, pid {record['pid']}, started {since}"
    except (OSError, ValueError, KeyError, TypeError):  # taken a moment ago, not yet recorded
        return "host and pid not recorded yet"
