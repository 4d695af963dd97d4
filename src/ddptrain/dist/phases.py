"""Where each rank is: its last phase (data fetch, forward, backward, optimizer step, step
agreement, evaluation, checkpoint) and global step, for the error a stalled job ends with.

A rank records a phase with one tuple assignment; a daemon thread publishes the newest record
to the process group's store twice a second when it changed, so the step loop never waits on
the network. When a collective times out, the surviving ranks read every record from the store
and name the ranks behind them and where they were, instead of a bare timeout. A rank stuck in
Python (a hung loader, a lock) keeps publishing the phase it is stuck in; a frozen process's
record is its last, at most half a second old when it froze.
"""

import json
import threading
import time

import torch.distributed as dist

from ddptrain.dist.env import DistEnv

# Within one global step, in the order a rank goes through them.
ORDER = ("data fetch", "forward", "backward", "optimizer step", "step agreement")
PUBLISH_EVERY = 0.5  # seconds
JOIN_WITHIN = 5.0  # seconds: a store call on a lost host gives up later; exit then anyway
_KEY = "ddptrain/phase/{rank}"
_ENDED = "ddptrain/ended_reported"
END_WITHIN = 3.0  # seconds a failed rank waits for the others to print their lines


class Phases:
    def __init__(self, env: DistEnv):
        self.env = env
        self.current = ("setup", 0, time.time())  # (phase, global step, when)
        self._store = _default_store() if env.distributed else None
        self._stopped = threading.Event()
        self._publisher = None
        if self._store is not None:
            self._publisher = threading.Thread(
                target=self._publish, name="ddptrain-phases", daemon=True
            )
            self._publisher.start()

    def enter(self, phase: str, global_step: int) -> None:
        self.current = (phase, global_step, time.time())

    def within_step(self, phase: str) -> None:
        """The next phase of the step entered last (the Step's forward, backward, ...)."""
        self.current = (phase, self.current[1], time.time())

    def close(self) -> None:
        """Stops the publisher and waits for it: a daemon thread still inside a store call when
        the interpreter exits is ended by a forced unwind through C++ code, which aborts the
        process ("terminate called without an active exception") after a run that succeeded."""
        self._stopped.set()
        if self._publisher is not None:
            self._publisher.join(timeout=JOIN_WITHIN)

    def end_together(self, within: float = END_WITHIN) -> None:
        """After this rank printed why it ends: waits until every rank has (or `within` seconds
        passed). A launcher ends all ranks as soon as the first exits, which cut off a rank
        that had more to print before its line (rank 0's list of bad images)."""
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

    def _publish(self) -> None:
        published = None
        while not self._stopped.wait(PUBLISH_EVERY):
            current = self.current
            if current != published:
                try:
                    self._store.set(_KEY.format(rank=self.env.rank), json.dumps(current))
                except Exception:  # the store's host is gone: nothing left to tell
                    return
                published = current

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
            f"rank {rank} was last in {phase} of global step {step} ({now - when:.0f} s ago)"
            for rank, (phase, step, when) in sorted(behind, key=lambda r: _position(r[1]))
        ]
        more = f"; and {len(named) - limit} more ranks" if len(named) > limit else ""
        return "; ".join(named[:limit]) + more


def _position(record) -> tuple[int, int]:
    phase, step, _ = record
    return step, ORDER.index(phase) if phase in ORDER else len(ORDER)


def _read(store: dist.Store, rank: int):
    key = _KEY.format(rank=rank)
    try:
        if not store.check([key]):  # get would wait for a key that never comes
            return None
        phase, step, when = json.loads(store.get(key))
    except Exception:
        return None
    return phase, int(step), float(when)


def _default_store() -> dist.Store | None:
    """The store the default process group was made with. torch has no public accessor; without
    one, the error stays the bare timeout."""
    get = getattr(dist.distributed_c10d, "_get_default_store", None)
    try:
        return get() if get is not None else None
    except Exception:
        return None
