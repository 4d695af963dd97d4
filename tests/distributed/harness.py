"""Runs a function on N real processes joined in a gloo process group, with a deadline."""

import multiprocessing
import os
import queue
import shutil
import tempfile
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from ddptrain.distributed.env import DistEnv
from ddptrain.distributed.ports import free_port


def _entry(fn, rank, world, port, results, args, log):
    # A forked rank's stdout and stderr would be the forkserver's, which are those of the test
    # that started it: each rank writes into its own file, shown when the ranks fail.
    with open(log, "wb") as out:
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)
    torch.set_num_threads(1)
    try:
        if world > 1:
            dist.init_process_group(
                "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
            )
        env = DistEnv(rank, world, rank, world, torch.device("cpu"))
        results.put((rank, _as_arrays(fn(env, *args)), None))
    except BaseException:
        results.put((rank, None, traceback.format_exc()))
    finally:
        # The result is sent before the teardown: a process that held two DDP models with
        # PowerSGD hooks sometimes aborted there inside torch ("Resource deadlock avoided").
        results.close()
        results.join_thread()
        if dist.is_initialized():
            dist.destroy_process_group()


def _as_arrays(value):
    """A tensor would travel as shared memory that dies with this process (its exit then raced
    the queue's feeder: "Resource deadlock avoided", or "Connection reset by peer" when the
    parent asked for the memory): send arrays, in tuples, lists and dicts too."""
    if isinstance(value, torch.Tensor):
        return value.detach().numpy()
    if isinstance(value, dict):
        return {key: _as_arrays(item) for key, item in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(map(_as_arrays, value))
    return value


def _as_tensors(value):
    if hasattr(value, "dtype") and hasattr(value, "shape"):
        return torch.from_numpy(value)
    if isinstance(value, dict):
        return {key: _as_tensors(item) for key, item in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(map(_as_tensors, value))
    return value


# Ranks are forked from a server process that imported these once, not spawned: a spawned
# process spends seconds importing torch and torchvision, and the suite starts hundreds. The
# server is a fresh interpreter (no threads, no process group), so forking it is safe. It keeps
# the environment it started with: the session's (no test here sets variables of its own).
_PRELOAD = ["torch", "torchvision", "ddptrain.run"]


def run_ranks(fn, world: int, *args, timeout: float = 120) -> list:
    """fn(env, *args) on each of `world` ranks; returns the results by rank. fn must be a module
    level function (processes are started afresh). A hang fails after `timeout` seconds."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    results = ctx.Queue()
    port = free_port()
    logs = Path(tempfile.mkdtemp(prefix="ranks-"))
    procs = [
        ctx.Process(target=_entry, args=(fn, r, world, port, results, args, logs / f"rank{r}.log"))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    collected = {}
    try:
        for _ in range(world):
            rank, value, error = results.get(timeout=timeout)
            if error:
                raise AssertionError(f"rank {rank} failed:\n{error}{_output(logs)}")
            collected[rank] = _as_tensors(value)
    except queue.Empty:
        raise AssertionError(f"ranks did not finish within {timeout} s{_output(logs)}") from None
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        shutil.rmtree(logs, ignore_errors=True)
    return [collected[r] for r in range(world)]


def _output(logs: Path, tail: int = 3000) -> str:
    """What each rank printed (its last `tail` characters)."""
    return "".join(
        f"\n--- output of {log.stem} ---\n{log.read_text(errors='replace')[-tail:]}"
        for log in sorted(logs.glob("rank*.log"))
    )
