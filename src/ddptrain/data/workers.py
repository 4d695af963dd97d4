"""Loader workers that leave the stop signals to the training process.

Schedulers signal every process of a job (SLURM tracks descendants; torchrun and `kill -- -PGID`
signal process groups), so a SIGTERM or SIGUSR1 reaches the DataLoader workers too. With
torch's handlers a worker then dies, and the training process's DataLoader turns that death
into a crash wherever it is, losing the stop's checkpoint. Here a worker only waits such
signals off a thread and drops them, except its parent's SIGTERM, which is how the DataLoader
ends a worker that does not stop by itself (it exits then, as torch's own handler does). The
training process decides for the whole run (train/preempt.py) and ends its workers when done.

Blocked, not ignored: a signal that lands between the worker's fork and its init stays pending
for the waiting thread instead of taking its default action. A process a worker starts inherits
the blocked mask.
"""

import contextlib
import multiprocessing
import os
import signal
import threading

from torch.utils.data import DataLoader

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Loader(DataLoader):
    """A DataLoader whose workers outlive stop signals meant for the run (module docstring)."""

    def __init__(self, *args, **kwargs):
        assert "worker_init_fn" not in kwargs
        super().__init__(*args, worker_init_fn=_leave_stop_signals, **kwargs)

    def __iter__(self):
        # Workers start here (once, with persistent workers): forked with the signals blocked.
        with _blocked(STOP_SIGNALS):
            return super().__iter__()


@contextlib.contextmanager
def _blocked(signals):
    """Blocks signals in this thread (a forked child inherits the mask): the process still
    hears them, through its other threads, or when they are unblocked."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _leave_stop_signals(worker_id: int) -> None:
    # Blocked here too, in case the mask was not inherited: every thread this worker starts
    # after this keeps them blocked.
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    # The DataLoader's process, also under forkserver, where getppid() is the fork server.
    parent = multiprocessing.parent_process().pid
    threading.Thread(target=_drop_stop_signals, args=(parent,), daemon=True).start()


def _drop_stop_signals(parent: int) -> None:
    while True:
        info = signal.sigwaitinfo(STOP_SIGNALS)
        if info.si_signo == signal.SIGTERM and info.si_pid == parent:
            os._exit(0)  # the DataLoader ending this worker
