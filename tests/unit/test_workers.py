"""Loader workers come from a fork server and leave SIGTERM and SIGUSR1 to the training process
(data/workers.py): a scheduler's signal to every process of the job kills neither them nor the
server; the DataLoader's own SIGTERM, which ends a worker that does not stop by itself, still
does."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from torch.utils.data import Dataset

from ddptrain.data import fork_server
from ddptrain.data.workers import Loader


class Pids(Dataset):
    def __len__(self) -> int:
        return 6

    def __getitem__(self, index: int) -> int:
        return os.getpid()


def wait_gone(pid: int, timeout: float = 10) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("context", ["fork", "forkserver"])
def test_a_stop_signal_from_another_process_leaves_the_worker_running(context):
    loader = Loader(Pids(), batch_size=1, num_workers=1, multiprocessing_context=context)
    batches = iter(loader)
    worker = int(next(batches)[0])
    for name in ("TERM", "USR1"):  # sent by another process, as a scheduler's
        subprocess.run(["kill", f"-{name}", str(worker)], check=True)
    time.sleep(0.5)
    assert [int(b[0]) for b in batches] == [worker] * 5


@pytest.mark.parametrize("context", ["fork", "forkserver"])
def test_the_loaders_own_sigterm_ends_the_worker(context):
    loader = Loader(Pids(), batch_size=1, num_workers=1, multiprocessing_context=context)
    batches = iter(loader)
    worker = int(next(batches)[0])
    os.kill(worker, signal.SIGTERM)  # from the worker's parent, as DataLoader's terminate()
    assert wait_gone(worker)
    del batches


def signals_in(status: str, field: str) -> set[int]:
    """The signals of a /proc/PID/status mask line (SigBlk, SigIgn)."""
    mask = int(re.search(rf"^{field}:\s*([0-9a-f]+)", status, re.M)[1], 16)
    return {signum for signum in range(1, 65) if mask & (1 << (signum - 1))}


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def test_workers_come_from_a_fork_server_with_no_threads_that_a_group_signal_leaves_alone():
    loader = Loader(Pids(), batch_size=1, num_workers=1)
    batches = iter(loader)
    worker = int(next(batches)[0])
    server = fork_server.pid()
    assert parent_of(worker) == server != os.getpid()
    assert os.listdir(f"/proc/{server}/task") == [str(server)]  # one thread: its own
    status = Path(f"/proc/{server}/status").read_text()
    assert {signal.SIGTERM, signal.SIGUSR1} <= signals_in(status, "SigBlk")
    assert signal.SIGINT in signals_in(status, "SigIgn")
    for name in ("TERM", "USR1", "INT"):  # as to the whole process group, from elsewhere
        subprocess.run(["kill", f"-{name}", str(server), str(worker)], check=True)
    time.sleep(0.5)
    assert [int(b[0]) for b in batches] == [worker] * 5  # the worker still serves
    assert not wait_gone(server, timeout=0.1)


LOADER_THEN_WAIT = """
import os, sys, time
sys.path.insert(0, {tests!r})
from test_workers import Pids
from ddptrain.data import fork_server
from ddptrain.data.workers import Loader

batches = iter(Loader(Pids(), batch_size=1, num_workers=1))
print(int(next(batches)[0]), fork_server.pid(), flush=True)
time.sleep(600)
"""


def test_a_killed_loader_leaves_no_worker_or_fork_server_behind():
    code = LOADER_THEN_WAIT.format(tests=str(Path(__file__).parent))
    loader = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        worker, server = map(int, loader.stdout.readline().split())
    finally:
        loader.kill()  # SIGKILL: nothing of the loader's process runs after it
        loader.wait()
    assert wait_gone(worker, 60) and wait_gone(server, 60)


def test_a_frozen_fork_server_does_not_outlive_the_loaders_process():
    code = LOADER_THEN_WAIT.format(tests=str(Path(__file__).parent)).replace(
        "time.sleep(600)",
        "sys.stdin.readline()",  # ends when told, as a run that is done
    )
    loader = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    worker, server = map(int, loader.stdout.readline().split())
    os.kill(server, signal.SIGSTOP)  # frozen: nothing but SIGKILL ends it
    os.kill(worker, signal.SIGSTOP)
    loader.communicate("\n", timeout=240)
    assert loader.returncode == 0
    assert wait_gone(worker, 60) and wait_gone(server, 60)


def test_a_rank_ended_now_takes_its_frozen_loader_worker_with_it():
    # As phases ends a rank that did not end with a failed one (its loader waiting on a frozen
    # worker): os._exit, no atexit. Found by bench/chaos_soak.py.
    code = LOADER_THEN_WAIT.format(tests=str(Path(__file__).parent)).replace(
        "time.sleep(600)",
        "import torch\n"
        "from ddptrain.distributed.env import DistEnv\n"
        "from ddptrain.distributed.phases import Phases\n"
        "sys.stdin.readline()\n"
        "Phases(DistEnv(1, 1, 0, 1, torch.device('cpu')))._end_now(failed=0)",
    )
    loader = subprocess.Popen(
        [sys.executable, "-c", code],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    worker, server = map(int, loader.stdout.readline().split())
    os.kill(worker, signal.SIGSTOP)
    _, stderr = loader.communicate("\n", timeout=240)
    assert loader.returncode == 1 and "ended now" in stderr
    assert wait_gone(worker, 60) and wait_gone(server, 60)
