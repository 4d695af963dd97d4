"""Preemption: SIGTERM or SIGUSR1 on any rank stops every rank at the same step boundary.

SLURM and cloud schedulers send one of these before they kill a job (torchrun passes SIGTERM on
to its workers and waits 30 s). A signal may reach only some ranks, or reach them at different
steps, so ranks agree through a tiny all-reduce started at each step boundary and read at the
next: a stop is acted on one step after the signal, at the same step on every rank, and the step
itself never waits for it.
"""

import signal
import threading

import torch
import torch.distributed as dist

from ddptrain.data.fork_server import STOP_SIGNALS
from ddptrain.distributed.collectives import start_max_on_cpu
from ddptrain.distributed.env import DistEnv
from ddptrain.errors import Stopped

# A MAX all-reduce of (this minus a step) finds the earliest step any rank reported.
_EARLIEST = 1 << 62


class StopRequests:
    """Use as a context manager around training: it installs the handlers and restores them."""

    def __init__(self, env: DistEnv):
        self.env = env
        self.received = 0  # the signal number this rank got, 0 for none
        # Steps trained since the last checkpoint (set by the trainer): what a stop saves.
        self.unsaved = False
        # Ranks agree on stops (set by the trainer from its first step loop to the end of fit):
        # a step boundary, where they agree, or the run's end is at most a step, an evaluation
        # or a checkpoint away.
        self.agreeing = False
        # The first global step with a non-finite loss that any rank saw (0: none), as of the
        # previous boundary: `report_nonfinite` rides the same all-reduce as the signals.
        self.nonfinite_step = 0
        self._nonfinite_key = 0
        self._pending: tuple[dist.Work, torch.Tensor] | None = None
        self._previous: dict = {}

    def __enter__(self) -> "StopRequests":
        if threading.current_thread() is threading.main_thread():  # where Python runs handlers
            self._previous = {s: signal.signal(s, self._on_signal) for s in STOP_SIGNALS}
        return self

    def __exit__(self, kind, value, traceback) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        if self._pending is not None and kind is None:
            self._pending[0].wait()  # leave no collective in flight behind a finished run

    def _on_signal(self, signum: int, frame) -> None:
        # While ranks agree, never an exit of this rank alone: the next boundary's agreement
        # stops every rank (in the last epoch's evaluation, the run ends first). Otherwise,
        # with nothing to save (setting up, stalled before the first step, or only evaluating),
        # no boundary may come: end this rank now, as the launcher asked.
        self.received = self.received or signum
        if not self.unsaved and not self.agreeing:
            name = signal.Signals(signum).name
            message = f"stopped by {name}: nothing trained since the last checkpoint"
            raise Stopped(signum, message, agreed=False)

    def report_nonfinite(self, global_step: int) -> None:
        """This rank saw a non-finite loss at global_step (read at a print step)."""
        self._nonfinite_key = max(self._nonfinite_key, _EARLIEST - global_step)

    def agreed(self) -> int:
        """The signal every rank stops for now (the highest number any rank received up to the
        previous boundary), or 0 to go on. A collective: every rank calls it at every step
        boundary."""
        if not self.env.distributed:
            self.nonfinite_step = _EARLIEST - self._nonfinite_key if self._nonfinite_key else 0
            return self.received
        stop = 0
        if self._pending is not None:
            work, flag = self._pending
            work.wait()
            stop, key = flag.tolist()  # a CPU tensor: no device synchronisation
            self.nonfinite_step = _EARLIEST - key if key else 0
        flag = torch.tensor([self.received, self._nonfinite_key], dtype=torch.int64)
        work = start_max_on_cpu(flag, self.env)
        self._pending = (work, flag)
        return stop
