"""Each rank's last phase goes through the process group's store: a rank that times out names
the ranks behind it and where they were."""

import threading
import time

import torch.distributed as dist
from harness import run_ranks

from ddptrain.dist.phases import PUBLISH_EVERY, Phases

WHERE = {0: ("backward", 7), 1: ("data fetch", 7), 2: ("forward", 8)}


def where_the_others_are(env):
    phases = Phases(env)
    phases.enter(*WHERE[env.rank])
    time.sleep(4 * PUBLISH_EVERY)  # published by the thread
    dist.barrier()
    stalled = phases.stalled()
    dist.barrier()
    phases.close()
    return stalled


def test_the_ranks_behind_are_named_with_their_phase():
    stalled = run_ranks(where_the_others_are, 3)
    assert stalled[0].startswith("rank 1 was last in data fetch of global step 7 (")
    assert "rank 2" not in stalled[0]  # ahead of rank 0
    assert stalled[1] == ""  # nobody is behind rank 1
    assert stalled[2].startswith("rank 1 was last in data fetch of global step 7 (")
    assert "; rank 0 was last in backward of global step 7 (" in stalled[2]


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
