import os
import signal

import pytest
import torch

from ddptrain.dist.env import DistEnv
from ddptrain.errors import Stopped
from ddptrain.train.preempt import StopRequests

ONE_PROCESS = DistEnv(0, 1, 0, 1, torch.device("cpu"))


def test_a_signal_asks_to_stop_and_the_handlers_are_restored():
    before = signal.getsignal(signal.SIGUSR1)
    with StopRequests(ONE_PROCESS) as stop:
        stop.unsaved = True  # steps trained since the last checkpoint: stop at a boundary
        assert stop.agreed() == 0
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.agreed() == signal.SIGUSR1
    assert signal.getsignal(signal.SIGUSR1) == before


def test_with_nothing_to_save_a_signal_stops_at_once():
    with pytest.raises(Stopped, match="nothing trained") as stopped, StopRequests(ONE_PROCESS):
        os.kill(os.getpid(), signal.SIGTERM)
    assert stopped.value.exit_code == 128 + signal.SIGTERM
