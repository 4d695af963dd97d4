"""The process loader workers start from (data/workers.py), one for each process that runs
loaders: a fork server, started afresh (spawned, not forked) and imported by nothing heavier
than the standard library, so that the CLI starts it before it imports torch itself.

Workers are never forked from the training process: by its first evaluation that process runs
gloo's threads, the phase publisher and the train loader's feeder, and a fork copies a lock
another thread holds without the thread that would release it; a val worker forked then could
wait on it forever (pytorch/pytorch#130610). The fork server (multiprocessing's "forkserver")
imports what workers need (PRELOAD) with one BLAS/OpenMP thread, so it runs no thread of its
own, and forks each worker from that state. It starts with SIGTERM and SIGUSR1 blocked and
SIGINT ignored: a signal to the whole process group (torchrun, srun, `kill -- -PGID`) must not
end it, since torch's worker watchdog takes a worker's parent, here the server, for the loader's
process and ends the worker when it goes. The server ends when the process that started it does.
A dataset is pickled to each of its workers, not shared by the fork.
"""

import atexit
import contextlib
import glob
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import os
import signal

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
# What workers import, loaded once by the fork server: the classes of the datasets and
# transforms pickled to them, and the decoders and readers these call.
PRELOAD = [
    "torch",
    "torchvision.transforms.v2",
    "ddptrain.data.check",
    "ddptrain.data.decode",
    "ddptrain.data.pack",
    "ddptrain.data.sampler",
    "ddptrain.data.shards",
    "ddptrain.data.tables",
    "ddptrain.data.transforms",
]
_ONE_THREAD = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
CONTEXT = multiprocessing.get_context("forkserver")


def start() -> None:
    """Starts this process's fork server where none runs (again, where it died), and returns at
    once: it imports PRELOAD on its own while the caller goes on, and the first worker waits
    for it. The CLI and the run call it early, to have it ready by their first batch; Loader,
    before any worker starts."""
    if _running(pid()):  # called at every loader's start: the environment is left alone
        return
    multiprocessing.set_forkserver_preload(PRELOAD)  # not "__main__": it would run the CLI
    # Started first, on its own: starting it unblocks SIGINT and SIGTERM in this thread.
    multiprocessing.resource_tracker.ensure_running()
    saved = {name: os.environ.get(name) for name in _ONE_THREAD}
    try:
        os.environ.update(dict.fromkeys(_ONE_THREAD, "1"))
        # Blocked in this thread, so in the server from its first instruction, and in each
        # worker; SIGINT stays blocked until the server ignores it (forkserver.main).
        with blocked((*STOP_SIGNALS, signal.SIGINT)):
            multiprocessing.forkserver.ensure_running()  # returns at once where it runs
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    if _owner != [os.getpid()]:
        _owner[:] = [os.getpid()]
        atexit.register(stop)


_owner: list[int] = []  # the process whose exit ends the server: not a child forked from it


def stop() -> None:
    """Ends the fork server and what is left of its workers (SIGKILL), at this process's exit.
    Both would end on their own once it is gone, but for one that is frozen (SIGSTOP): a frozen
    server would outlive the job, holding its resource tracker, and only SIGKILL ends it. No
    loader of this process runs by then (torch leaves its workers to end by themselves at
    exit)."""
    server = pid()
    if server is None or _owner != [os.getpid()]:
        return
    with contextlib.suppress(ProcessLookupError):
        # Stopped first: it reaps its workers as they end, and a pid it reaped could be
        # another process's by the time it is killed.
        os.kill(server, signal.SIGSTOP)
        for child in [*_children(server), server]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)


def _running(process: int | None) -> bool:
    """Whether the process runs (not ended, not a zombie), without reaping it: multiprocessing
    reaps its dead server itself, and restarts it."""
    fields = _stat(process) if process is not None else None
    return fields is not None and fields[0] not in ("Z", "X")


def _children(parent: int) -> list[int]:
    found = []
    for entry in glob.glob("/proc/[0-9]*"):
        fields = _stat(int(entry[6:]))
        if fields is not None and int(fields[1]) == parent:
            found.append(int(entry[6:]))
    return found


def _stat(process: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command's name (state, parent, ...), None for a
    process that is gone."""
    try:
        with open(f"/proc/{process}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def pid() -> int | None:
    """The pid of this process's fork server, None before it starts."""
    return multiprocessing.forkserver._forkserver._forkserver_pid


@contextlib.contextmanager
def blocked(signals):
    """Blocks signals in this thread (a child inherits the mask): the process still hears
    them, through its other threads, or when they are unblocked."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
