import os
import signal

import torch

from ddptrain.distributed import DistEnv
from ddptrain.preempt import StopRequests

ONE_PROCESS = DistEnv(0, 1, 0, 1, torch.device("cpu"))


def test_a_signal_asks_to_stop_and_the_handlers_are_restored():
    before = signal.getsignal(signal.SIGUSR1)
    with StopRequests(ONE_PROCESS) as stop:
        assert stop.agreed() == 0
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.agreed() == signal.SIGUSR1
    assert signal.getsignal(signal.SIGUSR1) == before
