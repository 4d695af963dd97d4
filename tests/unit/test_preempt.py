import os
import signal

import pytest
import torch

from ddptrain.distributed.env import DistEnv
from ddptrain.errors import Stopped, report
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


def test_in_the_step_loop_a_signal_with_nothing_to_save_waits_for_the_agreement():
    # A rank in the step loop never exits alone: with nothing trained since the last
    # checkpoint, the stop comes at the next boundary's agreement, as for every other rank.
    with StopRequests(ONE_PROCESS) as stop:
        stop.agreeing = True
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


def test_outside_the_step_loop_with_nothing_to_save_a_signal_stops_at_once():
    # No boundary may come (a rank stalled before its first step): the launcher's stop wins.
    with pytest.raises(Stopped, match="nothing trained") as stopped, StopRequests(ONE_PROCESS):
        os.kill(os.getpid(), signal.SIGTERM)
    assert not stopped.value.agreed  # the other ranks are told to end (run.train aborts them)
    assert report(stopped.value) == 128 + signal.SIGTERM  # ended by it, with nothing saved
