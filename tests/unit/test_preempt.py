import os
import signal

import torch

from ddptrain.dist.env import DistEnv
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


def test_with_nothing_to_save_a_signal_still_waits_for_the_agreement():
    # A rank never exits alone: with nothing trained since the last checkpoint, the stop comes
    # at the next boundary's agreement, as for every other rank (which then saves nothing).
    with StopRequests(ONE_PROCESS) as stop:
        assert not stop.unsaved
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.received == signal.SIGTERM
        assert stop.agreed() == signal.SIGTERM


def test_a_non_finite_loss_rides_the_agreement():
    with StopRequests(ONE_PROCESS) as stop:
        assert stop.agreed() == 0 and stop.nonfinite_step == 0
        stop.report_nonfinite(7)
        stop.report_nonfinite(9)  # a later one does not hide the first
        assert stop.agreed() == 0 and stop.nonfinite_step == 7
