"""Loader workers leave SIGTERM and SIGUSR1 to the training process (data/workers.py): a
scheduler's signal to every process of the job does not kill them; the DataLoader's own
SIGTERM, which ends a worker that does not stop by itself, still does."""

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from torch.utils.data import Dataset

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
