"""Fault injection for the test suite and bench/: kill or stall this process at a named point.

Inert unless the DDPTRAIN_TEST_* environment variables are set; nothing else reads them. The
training loop holds no test code: `Faults`, installed on a run (run.py) only when a variable asks
for it, follows the run through the phases every rank records anyway (Run.mark) and through
hooks on the model. The kill points and full disks of the atomic writes (state/files.py and the
writers) stay where the bytes are written.

- DDPTRAIN_TEST_KILL=POINT:RANK:STEP sends SIGKILL to global rank RANK at POINT of global step
  STEP (1-based: the step being taken). Points: `data` (as the step's batch is fetched, after
  the step's agreement),
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

_rank = 0  # this process's global rank, set by Faults.asked


class Faults:
    """This rank's faults in one run: created by `asked`, installed on the model by `install`,
    told of each phase by `entered` and of each val batch by `evaluating`."""

    def __init__(self, rank: int):
        self.rank = rank
        self.phase, self.step = "", 0  # the run's last phase (Run.mark) and its global step
        self.began = False  # the first step's data fetch was entered
        self.agreed_step = 0  # the last step whose agreement was entered
        self.gradient_poisoned_at = 0

    @classmethod
    def asked(cls, rank: int) -> "Faults | None":
        """The faults the environment asks of this rank's run, None when it asks for none."""
        global _rank
        _rank = rank  # for the kill points of the atomic writes
        if not any(os.environ.get(v) for v in (KILL, STALL, NAN, NAN_GRAD)):
            return None
        return cls(rank)

    def setup(self) -> None:
        """In setup, once the out-dir is locked."""
        maybe_stall(self.rank, "setup")

    def install(self, model) -> None:
        """model: the unwrapped model. Its first parameter's gradient comes last in backward,
        once DDP has all-reduced the other buckets (of a frozen backbone, the head's first)."""
        model.register_forward_pre_hook(self._on_forward)
        next(p for p in model.parameters() if p.requires_grad).register_hook(
            self._on_first_gradient
        )

    def entered(self, phase: str, global_step: int) -> None:
        self.phase, self.step = phase, global_step
        if phase == "step agreement":
            kill_point("between", global_step)
            self.agreed_step = global_step
        elif phase == "data fetch" and not self.began:  # before the run's first step
            self.began = True
            maybe_stall(self.rank)
        elif phase == "data fetch" and self.agreed_step == global_step:
            kill_point("data", global_step)

    def evaluating(self, global_step: int, batch: int) -> None:
        if batch == 1:  # the val loader's workers are running
            kill_point("evaluation", global_step)

    def _training(self) -> bool:
        """In a training step: its forward and backward follow its data fetch, the last phase
        Run.mark hears of before the next step's agreement (Step's own phases within the step
        go to Phases alone)."""
        return self.phase == "data fetch"

    def _on_forward(self, module, inputs):
        if self._training() and _asked(NAN, self.step):
            return (inputs[0] * float("nan"), *inputs[1:])
        return None

    def _on_first_gradient(self, grad):
        if not self._training():
            return grad
        kill_point("backward", self.step)
        if _asked(NAN_GRAD, self.step) and self.gradient_poisoned_at != self.step:
            self.gradient_poisoned_at = self.step  # once a step, whatever the accumulation
            return grad * float("nan")
        return grad


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
