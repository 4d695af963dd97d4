"""Where each rank is: its last phase (data fetch, forward, backward, optimizer step, step
agreement, evaluation and the batch it is on, the stage of a checkpoint) and global step, for the
error a stalled job ends with.

A rank records a phase with one tuple assignment; a daemon thread publishes the newest record
to the process group's store twice a second when it changed, and every HEARTBEAT seconds when it
did not, with the time it published it, so the step loop never waits on the network. When a
collective times out, the surviving ranks read every record from the store and name the ranks
that stopped answering (whose record has not been published again for FROZEN_AFTER, and does
not say the rank was ending: a frozen process, or a host lost) and those behind them, and where
each was, instead of a bare timeout.
A rank stuck in Python (a hung loader, a lock) keeps publishing the phase it is stuck in, so it
is named where it is behind; a frozen one is named wherever it froze, in the others' phase too.
Where a stall is named, the store is given STORE_TIMEOUT to answer: where its host is the frozen
one (rank 0, unless torchrun's agent holds the store), the line says so instead of waiting.

The same thread ends a rank that another rank's failure cannot reach: a failed rank sets an
abort flag in the store (`abort`), and a rank that sees it and has not ended on its own within
ABORT_GRACE (a gloo collective fails as soon as the failed rank exits; a NCCL collective or a
hung loader waits until --dist-timeout, or forever) prints why and exits. Without torchrun's
agent (--dist-url tcp://, SLURM's srun) nothing else would end it.
"""

import contextlib
import functools
import json
import os
import sys
import threading
import time

import torch.distributed as dist

from ddptrain.data import fork_server
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
HEARTBEAT = 2.0  # seconds: the record is published at least this often, changed or not
# Seconds since a rank last published before it counts as no longer answering: 3 heartbeats,
# and above the clock differences between hosts kept in time (NTP: milliseconds); below the
# least --dist-timeout worth having (10 s), after which a frozen rank's record is that old.
FROZEN_AFTER = 3 * HEARTBEAT
STORE_TIMEOUT = 3.0  # seconds the store is given to answer where a stall is being named
READ_WITHIN = 30.0  # seconds to read every rank's record, once the store answered at all
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
        store = _default_store() if env.distributed else None
        self._store, self._publishing = _client(store), _client(store)  # the caller's, its own
        self._silent = False  # the store stopped answering this rank's calls
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
        """This rank failed: the flag that ends the ranks its failure does not reach, and its
        record marked ended (not frozen, when it stops being published)."""
        self.ending = True
        if self._store is None or self._silent:
            return
        record = self._record(ended=True)

        def tell() -> None:
            self._store.set(_KEY.format(rank=self.env.rank), record)
            self._store.set(_ABORT, str(self.env.rank))

        try:  # a store whose host is gone: the others lose it too, and their collectives fail
            _answered(tell)
        except _NoAnswer:
            self._silent = True
        except Exception:
            pass

    def end_together(self, within: float = END_WITHIN) -> None:
        """After this rank printed why it ends: waits until every rank has (or `within` seconds
        passed). A launcher ends all ranks as soon as the first exits, which would cut off a
        rank with more to print before its line (rank 0's list of bad images)."""
        if self._store is None or self._silent:
            return
        deadline = time.monotonic() + within

        def wait() -> None:
            self._store.add(_ENDED, 1)
            while self._store.add(_ENDED, 0) < self.env.world_size:
                if time.monotonic() > deadline:
                    return  # the others are elsewhere (a collective, a hang): not ending with us
                time.sleep(0.05)

        with contextlib.suppress(Exception):  # the store's host is gone: nobody to wait for
            _answered(wait, within + STORE_TIMEOUT)

    def _watch(self) -> None:
        """Publishes this rank's phase when it changed, and ends it once another rank failed
        and it did not end on its own within ABORT_GRACE. From then on each store call is
        bounded (STORE_TIMEOUT): the failed rank's host may be gone, and the grace must end."""
        key = _KEY.format(rank=self.env.rank)
        published, failed, seen, tick, beat = None, None, 0.0, 0, 0.0
        while not self._stopped.wait(PUBLISH_EVERY):
            tick += 1
            if failed is not None and time.monotonic() - seen > ABORT_GRACE and not self.ending:
                self._end_now(failed)
            if self.ending:
                # Marked ended once more, after abort()'s own mark (another client's): a record
                # of this thread's still on its way would otherwise land last, "not ended".
                with contextlib.suppress(Exception):
                    _answered(lambda: self._publishing.set(key, self._record(ended=True)))
                return
            current = self.current
            try:
                if current != published or time.monotonic() - beat >= HEARTBEAT:
                    record = self._record(current)
                    publish = functools.partial(self._publishing.set, key, record)
                    publish() if failed is None else _answered(publish)
                    published, beat = current, time.monotonic()
                if failed is None and tick % ABORT_POLL == 0 and self._publishing.check([_ABORT]):
                    failed, seen = int(self._publishing.get(_ABORT)), time.monotonic()
            except Exception:  # the store's host is gone: nothing left to tell or hear
                if failed is None:
                    return

    def _record(self, current: tuple | None = None, ended: bool = False) -> str:
        """This rank's record as published: its phase, when it published it, and whether it
        is on its way out."""
        return json.dumps([*(current or self.current), time.time(), ended])

    def _end_now(self, failed: int) -> None:
        phase, step, _, _ = self.current
        write_line(
            f"ddptrain: error: rank {failed} failed (its own line says why), and rank "
            f"{self.env.rank}, in {phase} of global step {step}, did not end with it within "
            f"{ABORT_GRACE:.0f} s: ended now"
        )
        sys.stdout.flush()
        with contextlib.suppress(Exception):  # a failed rank in end_together need not wait
            _answered(lambda: self._publishing.add(_ENDED, 1))
        # os._exit skips atexit, which ends the loader workers: one frozen (SIGSTOP) cannot end
        # itself, and would keep its fork server and resource tracker alive after the job.
        fork_server.stop()
        os._exit(1)  # the main thread is blocked where no exception reaches it

    def stalled(self, limit: int = 8) -> str:
        """Names the ranks that stopped answering, and those behind this one, with their last
        phase, from the store: for the error of a collective that timed out. Empty when the
        store has nothing to say."""
        if self._store is None:
            return ""
        try:  # one call a live store answers at once, whatever the job's size
            _answered(lambda: self._store.check([_KEY.format(rank=self.env.rank)]))
        except _NoAnswer:
            self._silent = True
            return _store_silent()
        except Exception:
            return ""
        others = [rank for rank in range(self.env.world_size) if rank != self.env.rank]
        try:
            records = _answered(lambda: _records(self._store, others), READ_WITHIN)
        except Exception:  # slow rather than silent: better no names than wrong ones
            return ""
        now, mine = time.time(), _position(self.current)
        frozen = {
            r for r, (*_, beat, ended) in records.items() if not ended and now - beat > FROZEN_AFTER
        }
        behind = {r for r, record in records.items() if _position(record) < mine} - frozen
        named = [_frozen_line(r, records[r], now) for r in sorted(frozen)]
        by_position = sorted(behind, key=lambda r: _position(records[r]))
        named += [_behind_line(r, records[r], now) for r in by_position]
        more = f"; and {len(named) - limit} more ranks" if len(named) > limit else ""
        return "; ".join(named[:limit]) + more


class _NoAnswer(Exception):
    """The store did not answer within STORE_TIMEOUT."""


def _answered(call, within: float = STORE_TIMEOUT):
    """call()'s result, where it comes within `within` seconds; else _NoAnswer. On a thread of
    its own: a store client waits on a host that stopped answering (a frozen rank 0) for as
    long as its socket lives, whatever its timeout says (torch 2.14's TCPStore), so the thread
    is left waiting there."""
    done, outcome = threading.Event(), []

    def run() -> None:
        try:
            outcome.append((call(), None))
        except Exception as err:
            outcome.append((None, err))
        finally:
            done.set()

    threading.Thread(target=run, name="ddptrain-store-call", daemon=True).start()
    if not done.wait(within):
        raise _NoAnswer()
    result, error = outcome[0]
    if error is not None:
        raise error
    return result


def _where(record) -> str:
    phase, step, _, count = record[:4]
    return f"{phase}{f', batch {count},' if count else ''} of global step {step}"


def _frozen_line(rank: int, record, now: float) -> str:
    return (
        f"rank {rank} stopped answering {now - record[4]:.0f} s ago (a frozen process, or its "
        f"host lost), last seen in {_where(record)}"
    )


def _behind_line(rank: int, record, now: float) -> str:
    return f"rank {rank} was last in {_where(record)} ({now - record[2]:.0f} s ago)"


def _store_silent() -> str:
    """What a store that stopped answering says: its host is frozen or lost. torchrun's agent
    holds the store (TORCHELASTIC_USE_AGENT_STORE), else rank 0's process does."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        host = "torchrun's agent on the first node, which holds the rendezvous store,"
    else:
        host = "rank 0, which hosts the rendezvous store,"
    return (
        f"{host} stopped answering (within {STORE_TIMEOUT:.0f} s): a frozen process, or its "
        "host lost"
    )


def _position(record) -> tuple[int, int, int]:
    phase, step, _, count = record[:4]  # a rank's own current, or a record read
    return step, ORDER.index(phase) if phase in ORDER else len(ORDER), count


def _records(store: dist.Store, ranks: list[int]) -> dict:
    """The records of ranks that have one, in one round trip where all have (a get would wait
    for a key that never comes)."""
    keys = [_KEY.format(rank=rank) for rank in ranks]
    if store.check(keys):
        found = dict(zip(ranks, store.multi_get(keys), strict=True))
    else:
        found = {
            rank: store.get(key)
            for rank, key in zip(ranks, keys, strict=True)
            if store.check([key])
        }
    records = {rank: _parsed(raw) for rank, raw in found.items()}
    return {rank: record for rank, record in records.items() if record is not None}


def _parsed(raw: bytes):
    try:
        phase, step, when, count, beat, ended = json.loads(raw)
        return phase, int(step), float(when), int(count), float(beat), bool(ended)
    except (ValueError, TypeError):
        return None


def _default_store() -> dist.Store | None:
    """The store the default process group was made with. torch has no public accessor; without
    one, the error stays the bare timeout."""
    get = getattr(dist.distributed_c10d, "_get_default_store", None)
    try:
        return get() if get is not None else None
    except Exception:
        return None


def _client(store: dist.Store | None) -> dist.Store | None:
    """A client of store of its own, for one thread (torch's advice for a store used from
    several); the store itself where it makes no second client (a FileStore)."""
    if store is None:
        return None
    try:
        return store.clone()
    except Exception:
        return store
