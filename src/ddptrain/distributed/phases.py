"""Where each rank is: its last phase (data fetch, forward, backward, optimizer step, step
agreement, evaluation and the batch it is on, the stage of a checkpoint) and global step, for the
error a stalled job ends with.

A rank records a phase with one tuple assignment; a daemon thread publishes the newest record
to the process group's store twice a second when it changed, so the step loop never waits on
the network. When a collective times out, the surviving ranks read every record from the store
and name the ranks behind them and where they were, instead of a bare timeout. A rank stuck in
Python (a hung loader, a lock) keeps publishing the phase it is stuck in; a frozen process's
record is its last, at most half a second old when it froze.

The same thread ends a rank that another rank's failure cannot reach: a failed rank sets an
abort flag in the store (`abort`), and a rank that sees it and has not ended on its own within
ABORT_GRACE (a gloo collective fails as soon as the failed rank exits; a NCCL collective or a
hung loader waits until --dist-timeout, or forever) prints why and exits. Without torchrun's
agent (--dist-url tcp://, SLURM's srun) nothing else would end it.
"""

import contextlib
import json
import os
import sys
import threading
import time

import torch.distributed as dist

from ddptrain.distributed.env import DistEnv
from ddptrain.errors import write_line

# Within one global step, in the order a rank goes through them; then what follows a step (the
# epoch's evaluations, a checkpoint's stages), in their order. A phase's count (the evaluation's
# batch) orders ranks within it.
ORDER = (
    *("data fetch", "forward", "backward", "optimizer step", "step agreement"),
    *("evaluation", "EMA evaluation"),
    *("checkpoint: gathering", "checkpoint: writing", "checkpoint: written"),
)
PUBLISH_EVERY = 0.5  # seconds
JOIN_WITHIN = 5.0  # seconds: a store call on a lost host gives up later; exit then anyway
_KEY = "ddptrain/phase/{rank}"
_ENDED = "ddptrain/ended_reported"
END_WITHIN = 3.0  # seconds a failed rank waits for the others to print their lines
# Per launch attempt: a job torchrun restarts must not read the failure it restarts from.
_ABORT = f"ddptrain/abort/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
ABORT_GRACE = 10.0  # seconds a rank told of another's failure has to end on its own
ABORT_POLL = 4  # the flag is read every 4th publish (2 s): a store call per rank, kept rare


class Phases:
    def __init__(self, env: DistEnv):
        self.env = env
        self.current = ("setup", 0, time.time(), 0)  # (phase, global step, when, count)
        self._store = _default_store() if env.distributed else None
        self._stopped = threading.Event()
        self.ending = False  # this rank is on its way out: it reports its own end
        self._publisher = None
        if self._store is not None:
            self._publisher = threading.Thread(
                target=self._watch, name="ddptrain-phases", daemon=True
            )
            self._publisher.start()

    def enter(self, phase: str, global_step: int) -> None:
        self.current = (phase, global_step, time.time(), 0)

    def within_step(self, phase: str) -> None:
        """The next phase of the step entered last (the Step's forward, backward, ...)."""
        self.current = (phase, self.current[1], time.time(), 0)

    def count(self, n: int) -> None:
        """How far the phase has come (the evaluation's batch n)."""
        phase, step, _, _ = self.current
        self.current = (phase, step, time.time(), n)

    def close(self) -> None:
        """Stops the publisher and waits for it: a daemon thread still inside a store call when
        the interpreter exits is ended by a forced unwind through C++ code, which aborts the
        process ("terminate called without an active exception") after a run that succeeded."""
        self._stopped.set()
        if self._publisher is not None:
            self._publisher.join(timeout=JOIN_WITHIN)

    def abort(self) -> None:
        """This rank failed: the flag that ends the ranks its failure does not reach."""
        self.ending = True
        if self._store is not None:
            # A store whose host is gone: the others lose it too, and their collectives fail.
            with contextlib.suppress(Exception):
                self._store.set(_ABORT, str(self.env.rank))

    def end_together(self, within: float = END_WITHIN) -> None:
        """After this rank printed why it ends: waits until every rank has (or `within` seconds
        passed). A launcher ends all ranks as soon as the first exits, which would cut off a
        rank with more to print before its line (rank 0's list of bad images)."""
        if self._store is None:
            return
        deadline = time.monotonic() + within
        try:
            self._store.add(_ENDED, 1)
            while self._store.add(_ENDED, 0) < self.env.world_size:
                if time.monotonic() > deadline:
                    return  # the others are elsewhere (a collective, a hang): not ending with us
                time.sleep(0.05)
        except Exception:  # the store's host is gone: nobody left to wait for
            pass

    def _watch(self) -> None:
        """Publishes this rank's phase when it changed, and ends it once another rank failed
        and it did not end on its own within ABORT_GRACE."""
        published, failed, seen, tick = None, None, 0.0, 0
        while not self._stopped.wait(PUBLISH_EVERY):
            tick += 1
            if failed is not None:  # the store may be gone by now: it is not needed any more
                if time.monotonic() - seen > ABORT_GRACE and not self.ending:
                    self._end_now(failed)
                continue
            current = self.current
            try:
                if current != published:
                    self._store.set(_KEY.format(rank=self.env.rank), json.dumps(current))
                    published = current
                if tick % ABORT_POLL == 0 and self._store.check([_ABORT]):
                    failed, seen = int(self._store.get(_ABORT)), time.monotonic()
            except Exception:  # the store's host is gone: nothing left to tell or hear
                return

    def _end_now(self, failed: int) -> None:
        phase, step, _, _ = self.current
        write_line(
            f"ddptrain: error: rank {failed} failed (its own line says why), and rank "
            f"{self.env.rank}, in {phase} of global step {step}, did not end with it within "
            f"{ABORT_GRACE:.0f} s: ended now"
        )
        sys.stdout.flush()
        with contextlib.suppress(Exception):  # a failed rank in end_together need not wait
            self._store.add(_ENDED, 1)
        os._exit(1)  # the main thread is blocked where no exception reaches it

    def stalled(self, limit: int = 8) -> str:
        """Names the ranks behind this one and their last phase, from the store: for the error
        of a collective that timed out. Empty when the store has nothing to say."""
        if self._store is None:
            return ""
        mine = _position(self.current)
        behind = []
        for rank in range(self.env.world_size):
            record = None if rank == self.env.rank else _read(self._store, rank)
            if record is not None and _position(record) < mine:
                behind.append((rank, record))
        if not behind:
            return ""
        now = time.time()
        named = [
            f"rank {rank} was last in {phase}{f', batch {count},' if count else ''} of global "
            f"step {step} ({now - when:.0f} s ago)"
            for rank, (phase, step, when, count) in sorted(behind, key=lambda r: _position(r[1]))
        ]
        more = f"; and {len(named) - limit} more ranks" if len(named) > limit else ""
        return "; ".join(named[:limit]) + more


def _position(record) -> tuple[int, int, int]:
    phase, step, _, count = record
    return step, ORDER.index(phase) if phase in ORDER else len(ORDER), count


def _read(store: dist.Store, rank: int):
    key = _KEY.format(rank=rank)
    try:
        if not store.check([key]):  # get would wait for a key that never comes
            return None
        phase, step, when, count = json.loads(store.get(key))
    except Exception:
        return None
    return phase, int(step), float(when), int(count)


def _default_store() -> dist.Store | None:
    """The store the default process group was made with. torch has no public accessor; without
    one, the error stays the bare timeout."""
    get = getattr(dist.distributed_c10d, "_get_default_store", None)
    try:
        return get() if get is not None else None
    except Exception:
        return None
