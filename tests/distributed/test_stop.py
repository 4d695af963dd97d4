"""A stop signal that reaches one rank stops every rank at the same step boundary."""

import os
import signal

from harness import run_ranks

from ddptrain.train.preempt import StopRequests


def _boundary_of_stop(env, signalled_rank, signal_at):
    with StopRequests(env) as stop:
        stop.unsaved = True  # as after a step: a signal waits for the agreement
        for boundary in range(20):
            if boundary == signal_at and env.rank == signalled_rank:
                os.kill(os.getpid(), signal.SIGTERM)
            if stop.agreed():
                return boundary, stop.received
    return None, None


def test_every_rank_stops_at_the_same_boundary_one_step_after_the_signal():
    results = run_ranks(_boundary_of_stop, 2, 1, 5, timeout=60)
    # Signalled before boundary 5's agreement starts: that one still says go on, boundary 6 stops.
    assert [boundary for boundary, _ in results] == [6, 6]
    assert [received for _, received in results] == [0, signal.SIGTERM]
