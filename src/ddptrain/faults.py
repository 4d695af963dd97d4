"""Fault injection for the test suite and bench/: kill or stall this process at a named point.

Inert unless the DDPTRAIN_TEST_* environment variables are set; nothing else reads them.

- DDPTRAIN_TEST_KILL=POINT:RANK:STEP sends SIGKILL to global rank RANK at POINT of global step
  STEP (1-based: the step being taken). Points: `data` (while the step's batch is being loaded),
  `backward` (inside the backward pass, some gradient buckets already all-reduced), `between`
  (before the step starts), `evaluation` (at the first val batch after global step STEP),
  `before_rename` and `after_rename` (while committing a checkpoint file written at step STEP).
- DDPTRAIN_TEST_KILL_ONCE=PATH: kill only while PATH does not exist, and create it first, so the
  run restarted after the kill goes through.
- DDPTRAIN_TEST_SIGNAL=NAME sends signal NAME (e.g. SIGTERM) instead of SIGKILL.
- DDPTRAIN_TEST_STALL_RANK=N hangs rank N forever before its first step, as a wedged process;
  N:setup hangs it in setup instead, once it holds the out-dir's lock.
- DDPTRAIN_TEST_NAN=RANK:STEP[,STEP...] makes global rank RANK's batch NaN at each global step
  STEP, as a blow-up on one rank.
- DDPTRAIN_TEST_NAN_GRAD=RANK:STEP[,STEP...] makes global rank RANK's first gradient NaN at
  each global step STEP while its loss stays finite, as a backward that overflows.
- DDPTRAIN_TEST_ENOSPC=GLOB makes every write of a file whose name matches GLOB (fnmatch, e.g.
  `checkpoint-000000006.pt`, `config.json`, `metrics.jsonl`, `*.png`, `model_best.dcp`) fail as
  on a full disk, once its bytes are written and before they are committed.
"""

import errno
import fnmatch
import os
import signal
import time
from pathlib import Path

KILL, ONCE, SIGNAL, STALL, NAN, NAN_GRAD, ENOSPC = (
    "DDPTRAIN_TEST_KILL",
    "DDPTRAIN_TEST_KILL_ONCE",
    "DDPTRAIN_TEST_SIGNAL",
    "DDPTRAIN_TEST_STALL_RANK",
    "DDPTRAIN_TEST_NAN",
    "DDPTRAIN_TEST_NAN_GRAD",
    "DDPTRAIN_TEST_ENOSPC",
)
POINTS = ("data", "backward", "between", "evaluation", "before_rename", "after_rename")

_rank = 0  # this process's global rank, set by the trainer


def set_rank(rank: int) -> None:
    global _rank
    _rank = rank


def armed(point: str, step: int) -> bool:
    """Whether DDPTRAIN_TEST_KILL asks for a kill at this point of this step on this rank."""
    spec = os.environ.get(KILL)
    if not spec:
        return False
    want_point, want_rank, want_step = spec.split(":")
    assert want_point in POINTS, f"{KILL}: unknown point {want_point}"
    return (want_point, int(want_rank), int(want_step)) == (point, _rank, step)


def kill_point(point: str, step: int) -> None:
    if not armed(point, step):
        return
    once = os.environ.get(ONCE)
    if once:
        if Path(once).exists():
            return
        Path(once).touch()
    # Delivered before os.kill returns: a signal a process sends itself is not deferred.
    os.kill(os.getpid(), signal.Signals[os.environ.get(SIGNAL, "SIGKILL")])


def _asked(variable: str, step: int) -> bool:
    """Whether `variable` (RANK:STEP[,STEP...]) names this rank and global step."""
    rank, _, steps = os.environ.get(variable, "").partition(":")
    return rank == str(_rank) and str(step) in steps.split(",")


def poison(images, step: int):
    """images, or NaN in their place where DDPTRAIN_TEST_NAN asks for it at this step."""
    if _asked(NAN, step):
        return images * float("nan")
    return images


def poison_gradient(model, step: int) -> None:
    """The first parameter's gradient NaN in this step's backward, where DDPTRAIN_TEST_NAN_GRAD
    asks for it (once: the hook passes gradients through after that)."""
    if not _asked(NAN_GRAD, step):
        return
    used = []

    def once(grad):
        if used:
            return grad
        used.append(True)
        return grad * float("nan")

    next(model.parameters()).register_hook(once)


def maybe_stall(rank: int, where: str = "") -> None:
    """Hangs here where DDPTRAIN_TEST_STALL_RANK names this rank and place ("" or "setup")."""
    if os.environ.get(STALL) == f"{rank}:{where}".removesuffix(":"):
        while True:
            time.sleep(3600)


def disk_full(path: os.PathLike | str) -> None:
    """Raises what a full disk raises when DDPTRAIN_TEST_ENOSPC matches the name of path."""
    pattern = os.environ.get(ENOSPC)
    if pattern and fnmatch.fnmatchcase(Path(path).name, pattern):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
