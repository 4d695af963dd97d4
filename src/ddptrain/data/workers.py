"""Loader workers started from a fork server (data/fork_server.py), that leave the stop signals
to the training process.

Schedulers signal every process of a job (SLURM tracks descendants; torchrun and `kill -- -PGID`
signal process groups), so a SIGTERM or SIGUSR1 reaches the DataLoader workers too. With
torch's handlers a worker then dies, and the training process's DataLoader turns that death
into a crash wherever it is, losing the stop's checkpoint. Here a worker only waits such
signals off a thread and drops them, except its loader's SIGTERM, which is how the DataLoader
ends a worker that does not stop by itself (it exits then, as torch's own handler does). The
training process decides for the whole run (train/preempt.py) and ends its workers when done.

Blocked, not ignored: a signal that lands between the worker's start and its init stays pending
for the waiting thread instead of taking its default action. A process a worker starts inherits
the blocked mask.
"""

import multiprocessing
import os
import select
import signal
import threading
import time

from torch.utils.data import DataLoader

from ddptrain.data import fork_server
from ddptrain.data.fork_server import STOP_SIGNALS


class Loader(DataLoader):
    """A DataLoader whose workers come from a fork server and outlive stop signals meant for
    the run (module docstring)."""

    def __init__(self, *args, **kwargs):
        assert "worker_init_fn" not in kwargs
        if kwargs.get("num_workers", 0) > 0 and "multiprocessing_context" not in kwargs:
            kwargs["multiprocessing_context"] = fork_server.CONTEXT
        super().__init__(*args, worker_init_fn=_leave_stop_signals, **kwargs)

    def __iter__(self):
        # Workers start here (once, with persistent workers), from the fork server (started
        # again if it died), or forked with the signals blocked where the caller asked for it.
        if self.num_workers > 0 and self.multiprocessing_context is fork_server.CONTEXT:
            fork_server.start()
        with fork_server.blocked(STOP_SIGNALS):
            return super().__iter__()


def _leave_stop_signals(worker_id: int) -> None:
    # Blocked here too, in case the mask was not inherited: every thread this worker starts
    # after this keeps them blocked.
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    # The DataLoader's process, also under forkserver, where getppid() is the fork server.
    parent = multiprocessing.parent_process().pid
    threading.Thread(target=_drop_stop_signals, args=(parent,), daemon=True).start()
    threading.Thread(target=_end_with, args=(parent,), daemon=True).start()


def _end_with(loader: int) -> None:
    """Ends this worker when the loader's process ends, however it ends (SIGKILL too). torch's
    watchdog watches the worker's parent, here the fork server, which lives on while any of its
    workers does: without this, a killed run would leave them both running (holding its
    stdout and stderr open)."""
    try:
        watched = os.pidfd_open(loader)
    except ProcessLookupError:  # gone already
        os._exit(0)
    except OSError:  # no pidfd (Linux before 5.3): look twice a second
        while _alive(loader):
            time.sleep(0.5)
        os._exit(0)
    select.select([watched], [], [])  # readable once the process has ended
    os._exit(0)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _drop_stop_signals(parent: int) -> None:
    while True:
        info = signal.sigwaitinfo(STOP_SIGNALS)
        if info.si_signo == signal.SIGTERM and info.si_pid == parent:
            os._exit(0)  # the DataLoader ending this worker
