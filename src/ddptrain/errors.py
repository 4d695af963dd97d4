"""The one error type users see, and how every entry point reports it and ends."""

import errno
import gc
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn, TextIO


class UserError(ValueError):
    """A mistake the user can fix: one line naming the path or flag, never a traceback."""


class WriteFailed(UserError, OSError):
    """A file ddptrain writes could not be written (a full disk, a quota, an I/O error): the
    user's to fix, so one line; still an OSError for code that handles those."""


def write_failed(path, err: OSError, needed: int | None = None, hint: str = "") -> WriteFailed:
    """The one line for a failed write of `path`: what the system said and, for a full disk or
    whenever the size is known, the bytes the file needs against those free there."""
    line = f"cannot write {path}: {err.strerror or first_line(err)}"
    if needed is not None or err.errno in (errno.ENOSPC, errno.EDQUOT):
        line += _room(Path(path).parent, needed)
    return WriteFailed(f"{line}; {hint}" if hint else line)


def _room(directory: Path, needed: int | None) -> str:
    try:
        free = f"{directory} has {format_bytes(shutil.disk_usage(directory).free)} free"
    except OSError:
        free = f"the free space in {directory} is unknown"
    return f" (it needs {format_bytes(needed)}, {free})" if needed is not None else f" ({free})"


def format_bytes(count: float) -> str:
    units = ["B", "KiB", "MiB", "GiB", "TiB"]
    while count >= 1024 and len(units) > 1:
        count, units = count / 1024, units[1:]
    return f"{count:.0f} B" if units[0] == "B" else f"{count:.1f} {units[0]}"


class Stopped(Exception):
    """A stop on a signal (preemption).

    Agreed: every rank stopped at the same step and saved what it had trained. It exits 0: the
    run did what the signal asked and lost nothing; a non-zero code would make `torchrun
    --max-restarts` start the group again, resuming what was to stop. Not agreed: this rank
    alone, signalled before its first step or while only evaluating, where no step boundary
    comes; the others must be told to end, and it exits 128 + the signal's number, the shell's
    code for "ended by this signal" (nothing was saved: there was nothing to save).
    """

    def __init__(self, signum: int, message: str, agreed: bool = True):
        super().__init__(message)
        self.signum = signum
        self.agreed = agreed

    @property
    def exit_code(self) -> int:
        return 0 if self.agreed else 128 + self.signum


def first_line(err: BaseException) -> str:
    """The head of a library error's message (torch's can run to pages), or its type's name."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def printable(text: str) -> str:
    """text with what a terminal would act on or cannot show escaped as Python writes it
    (newlines, escape codes, lone surrogates): a name read from a file or a server (a packed
    set's index) can then forge no line of output."""
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


def one_line(err: BaseException) -> str:
    """The user-facing message of err.

    A DataLoader worker's exception reaches the main process rebuilt with the worker's whole
    traceback as its message; the original message is its last line.
    """
    text = str(err).strip()
    if "Original Traceback" in text:
        last = text.splitlines()[-1]
        text = last.split(": ", 1)[1] if last.startswith(("UserError", "ddptrain.")) else last
    return text


# How a dead or stalled peer shows up: torch's DistError types, or RuntimeErrors from gloo whose
# wording depends on where the collective was ("Timed out waiting ...", "Application timeout caused
# pair closure", "Connection closed by peer", ...). Matched in lower case.
_PEER_LOST = (
    "closed by peer",
    "reset by peer",
    "timed out waiting",  # gloo: "Timed out waiting 10000ms for recv operation to complete"
    "application timeout caused pair closure",
    "gloo/transport",
)


def peer_lost(err: BaseException) -> str | None:
    """What says a peer is gone, or None when err is something else."""
    import torch.distributed as dist

    if isinstance(err, dist.DistError):
        return type(err).__name__
    if isinstance(err, RuntimeError):
        message = str(err).lower()
        return next((s for s in _PEER_LOST if s in message), None)
    return None


def report_errors(action: Callable[[], object]) -> int:
    """Run action and turn the failures a user can act on into one line and an exit code (see
    `report`); anything else is a bug and keeps its traceback. Every ddptrain process runs in
    one of these."""
    _printable_paths()
    try:
        action()
    except BaseException as err:
        code = report(err)
        if code is None:
            raise
        return code
    return 0


def end_process(code: int) -> NoReturn:
    """Ends a ddptrain process (its `__main__`, a spawned rank, a plan's trace) with `code`,
    1 to 2 s sooner for the user: frozen, the objects torch made at import skip the
    interpreter's last collections (atexit and flushing still run; ddptrain leaves nothing in a
    reference cycle that needs finalizing)."""
    gc.freeze()
    sys.exit(code)


def _printable_paths() -> None:
    """A path need not be UTF-8 (an image or folder named in Latin-1): printed to a stdout that
    is strict about it (a UTF-8 locale's), it ended the run in a UnicodeEncodeError. It is
    shown escaped instead, as Python's stderr shows it."""
    if getattr(sys.stdout, "errors", None) == "strict" and hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(errors="backslashreplace")


def report(err: BaseException) -> int | None:
    """Prints the one line for a failure the user can act on and returns its exit code, or None
    for anything else. Prints once per error, however many callers report it.

    User mistakes exit 2 (like argparse); a lost peer exits 1; a stop on SIGTERM or SIGUSR1
    exits 0 once every rank saved, 128 + the signal's number for a rank stopped alone (see
    Stopped); Ctrl-C exits 130.
    """
    reported = getattr(err, "_ddptrain_exit_code", None)
    if reported is not None:
        return reported
    code, line = _exit_line(err)
    if code is not None:
        write_line(line)
        err._ddptrain_exit_code = code
    return code


def write_line(line: str, stream: TextIO | None = None) -> None:
    """A line on `stream` (stderr by default) in one write: every rank writes into the same
    pipes, and under PYTHONUNBUFFERED print's separate write of the newline let another rank's
    line land in the middle of this one."""
    stream = stream or sys.stderr
    stream.write(f"{line}\n")
    stream.flush()


def _exit_line(err: BaseException) -> tuple[int | None, str]:
    if isinstance(err, UserError):
        return 2, f"ddptrain: error: {one_line(err)}"
    if isinstance(err, Stopped):
        return err.exit_code, f"ddptrain: {err}"
    if isinstance(err, KeyboardInterrupt):
        return 130, "ddptrain: interrupted"
    reason = peer_lost(err) if isinstance(err, Exception) else None
    if reason is None:
        return None, ""
    where = "".join(f"; {note}" for note in getattr(err, "__notes__", ()))
    return 1, (
        "ddptrain: error: lost contact with another rank, which failed or stalled (see its "
        f"output; --dist-timeout sets how long ranks wait for each other) ({reason}){where}"
    )
