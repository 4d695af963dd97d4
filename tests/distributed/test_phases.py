"""Each rank's last phase goes through the process group's store: a rank that times out names
the ranks behind it and where they were."""

import os
import signal
import threading
import time

import pytest
import torch.distributed as dist
from harness import run_ranks

from ddptrain.distributed import phases as phases_module
from ddptrain.distributed.phases import PUBLISH_EVERY, Phases

pytestmark = pytest.mark.serial  # the tests time the ranks' waits to tenths of a second

WHERE = {0: ("backward", 7, 0), 1: ("data fetch", 7, 0), 2: ("forward", 8, 0)}


def stalled_in(env, where):
    phases = Phases(env)
    phase, step, count = where[env.rank]
    phases.enter(phase, step)
    phases.count(count)
    time.sleep(4 * PUBLISH_EVERY)  # published by the thread
    dist.barrier()
    stalled = phases.stalled()
    dist.barrier()
    phases.close()
    return stalled


def test_the_ranks_behind_are_named_with_their_phase():
    stalled = run_ranks(stalled_in, 3, WHERE)
    assert stalled[0].startswith("rank 1 was last in data fetch of global step 7 (")
    assert "rank 2" not in stalled[0]  # ahead of rank 0
    assert stalled[1] == ""  # nobody is behind rank 1
    assert stalled[2].startswith("rank 1 was last in data fetch of global step 7 (")
    assert "; rank 0 was last in backward of global step 7 (" in stalled[2]


def test_a_rank_behind_in_evaluation_is_named_with_its_batch():
    # All ranks evaluate after the same step: the batch tells which one stopped.
    where = {0: ("evaluation", 6, 10), 1: ("evaluation", 6, 3)}
    stalled = run_ranks(stalled_in, 2, where)
    assert stalled[0].startswith("rank 1 was last in evaluation, batch 3, of global step 6 (")
    assert stalled[1] == ""


def test_rank_0_stuck_writing_a_checkpoint_is_named_by_the_others():
    where = {0: ("checkpoint: writing", 6, 0), 1: ("checkpoint: written", 6, 0)}
    stalled = run_ranks(stalled_in, 2, where)
    assert stalled[1].startswith("rank 0 was last in checkpoint: writing of global step 6 (")
    assert stalled[0] == ""
    after_eval = {0: ("checkpoint: gathering", 6, 0), 1: ("EMA evaluation", 6, 40)}
    assert run_ranks(stalled_in, 2, after_eval)[0].startswith("rank 1 was last in EMA evaluation")


def frozen(env, who: int):
    """Both ranks in backward of step 7; rank `who` freezes (SIGSTOP, as a host that hangs)
    and the other, once it has waited longer than FROZEN_AFTER, says what it sees, then lets
    the frozen one go on (SIGCONT)."""
    phases_module.HEARTBEAT, phases_module.FROZEN_AFTER = 0.5, 2.0
    phases = Phases(env)
    phases.enter("backward", 7)
    pids = [None, None]
    dist.all_gather_object(pids, os.getpid())
    time.sleep(4 * PUBLISH_EVERY)  # published
    if env.rank == who:
        os.kill(os.getpid(), signal.SIGSTOP)
        said, took = "", 0.0
    else:
        time.sleep(3.0)
        started = time.monotonic()
        said = phases.stalled()
        took = time.monotonic() - started
        os.kill(pids[who], signal.SIGCONT)
    phases.close()
    return said, took


def test_a_frozen_rank_is_named_in_the_same_phase_as_the_others():
    said, took = run_ranks(frozen, 2, 1)[0]
    assert said.startswith("rank 1 stopped answering "), said
    assert said.endswith(
        " s ago (a frozen process, or its host lost), last seen in backward of global step 7"
    )
    assert took < 1.0


def test_a_frozen_rank_0_holding_the_store_is_named_without_waiting_for_it():
    said, took = run_ranks(frozen, 2, 0)[1]
    assert said == (
        "rank 0, which hosts the rendezvous store, stopped answering (within 3 s): a frozen "
        "process, or its host lost"
    )
    assert took < phases_module.STORE_TIMEOUT + 2


def ended_then_waited_for(env):
    """Rank 1 fails (abort: its record says it is ending) and stops publishing; rank 0, a
    phase ahead and longer than FROZEN_AFTER later, names it behind, not frozen."""
    phases_module.HEARTBEAT, phases_module.FROZEN_AFTER = 0.5, 2.0
    phases = Phases(env)
    phases.enter("forward", 3)
    time.sleep(4 * PUBLISH_EVERY)
    if env.rank == 1:
        phases.abort()
        phases.close()
    dist.barrier()
    said = ""
    if env.rank == 0:
        phases.within_step("backward")
        time.sleep(3.0)
        said = phases.stalled()
    dist.barrier()
    phases.close()
    return said


def test_a_rank_that_failed_and_ended_is_not_called_frozen():
    said = run_ranks(ended_then_waited_for, 2)[0]
    assert said.startswith("rank 1 was last in forward of global step 3 ("), said
    assert "stopped answering" not in said


def publishers_left_after_close(env):
    phases = Phases(env)
    for step in range(20):  # keep the publisher busy with new records up to the close
        phases.enter("forward", step)
        time.sleep(PUBLISH_EVERY / 10)
    phases.close()
    return [t.name for t in threading.enumerate() if t.name == "ddptrain-phases"]


def test_close_waits_for_the_publisher():
    """A daemon thread still inside a store call at interpreter exit aborts the process
    ("terminate called without an active exception") after a run that succeeded."""
    assert run_ranks(publishers_left_after_close, 2) == [[], []]


def seconds_to_end(env):
    """How long end_together kept this rank; rank 0 ends (prints its line) 1 s after rank 1."""
    phases = Phases(env)
    dist.barrier()
    if env.rank == 0:
        time.sleep(1.0)
    started = time.monotonic()
    phases.end_together(within=3.0)
    waited = time.monotonic() - started
    phases.close()
    return waited


def test_a_failed_rank_waits_for_the_others_to_say_why_too():
    # A launcher ends all ranks once the first exits: rank 1 must not exit before rank 0,
    # slower to its line, has printed it.
    late, early = run_ranks(seconds_to_end, 2)
    assert late < 0.5 and 0.7 < early < 2.5, (late, early)


def alone(env):
    phases = Phases(env)
    started = time.monotonic()
    if env.rank == 1:
        phases.end_together(within=1.0)  # rank 0 carries on (in a collective, say)
    else:
        time.sleep(2.0)
    waited = time.monotonic() - started
    phases.close()
    return waited


def test_a_rank_ending_alone_gives_up_after_within():
    assert 0.9 < run_ranks(alone, 2)[1] < 1.8
