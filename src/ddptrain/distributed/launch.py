"""--multiprocessing-distributed: one process per device on this node, through mp.spawn.

As in the classic example, --world-size and --rank mean nodes and this node's rank here.
"""

import contextlib
import os
import signal
import time
from collections.abc import Callable

import torch
import torch.multiprocessing as mp

from ddptrain.config import Config, LaunchSettings
from ddptrain.config_layers import Layers, check_batch_divides_early
from ddptrain.distributed.env import SpawnSlot
from ddptrain.distributed.ports import free_port
from ddptrain.errors import UserError, end_process, report_errors

# Stops the ranks act on (train/preempt.py), passed on from this process as torchrun passes them
# on to its workers: `docker stop` and Kubernetes signal PID 1, here this process, alone.
PASSED_ON = (signal.SIGTERM, signal.SIGUSR1)
# A SIGINT to this process alone (`kill -INT`) is passed on after this long: a terminal's Ctrl-C
# reaches every rank itself, and a second one would break into their ending.
INTERRUPT_GRACE_S = 5.0


def _default_nproc(launch: LaunchSettings) -> int:
    if launch.no_accel or launch.device == "cpu":
        return 1
    accelerator = torch.accelerator.current_accelerator(check_available=True)
    return torch.accelerator.device_count() if accelerator is not None else 1


def _rendezvous(launch: LaunchSettings, nodes: int) -> str:
    """Where the ranks meet. env:// without MASTER_ADDR on one node: a free local port."""
    if launch.dist_url != "env://":
        return launch.dist_url
    if "MASTER_ADDR" in os.environ:
        if "MASTER_PORT" not in os.environ:
            raise UserError("MASTER_ADDR is set but MASTER_PORT is not (--dist-url env://)")
        return launch.dist_url
    if nodes > 1:
        raise UserError(
            "--multiprocessing-distributed on several nodes needs --dist-url tcp://HOST:PORT "
            "of node 0 (or MASTER_ADDR and MASTER_PORT)"
        )
    return f"tcp://127.0.0.1:{free_port()}"


def _nodes(launch: LaunchSettings) -> tuple[int, int]:
    """(nodes, this node's rank): --world-size and --rank, or under env:// without them
    WORLD_SIZE and RANK, which the classic example reads there as the same two numbers."""
    nodes, node_rank = launch.world_size, launch.rank
    if launch.dist_url == "env://":
        nodes = nodes if nodes > 0 else int(os.environ.get("WORLD_SIZE", 1))
        node_rank = node_rank if node_rank >= 0 else int(os.environ.get("RANK", -1))
    nodes = max(nodes, 1)
    if nodes > 1 and not 0 <= node_rank < nodes:
        raise UserError(
            f"--multiprocessing-distributed with --world-size {nodes} (nodes) needs --rank, "
            "this node's rank, from 0 to the number of nodes - 1"
        )
    return nodes, max(node_rank, 0)


def _worker(
    local_rank: int,
    train: Callable,
    config: Config,
    layers: Layers,
    nproc: int,
    nodes: tuple[int, int],
    url: str,
) -> None:
    slot = SpawnSlot(local_rank, nproc, nodes[1], nodes[0], url)
    end_process(report_errors(lambda: train(config, slot, layers)))


def spawn(config: Config, layers: Layers, train: Callable[..., object]) -> int:
    """Runs train(config, slot, layers) on --nproc-per-node processes; returns the exit code of
    the first failure. train is run.train, passed in (a module-level function, which mp.spawn
    pickles by name): the dist wing does not import the run above it.

    When one process fails, mp.spawn ends the others, so no rank is left waiting.
    """
    launch = config.launch
    nproc = launch.nproc_per_node or _default_nproc(launch)
    nodes, node_rank = _nodes(launch)
    # each rank checks a resumed -b itself
    check_batch_divides_early(config, layers, nproc * nodes)
    url = _rendezvous(launch, nodes)
    args = (train, config, layers, nproc, (nodes, node_rank), url)
    context = mp.spawn(_worker, args=args, nprocs=nproc, join=False)
    try:
        _wait(context)
    except mp.ProcessExitedException as err:
        return err.exit_code if err.exit_code > 0 else 1
    return 0


def _wait(context: mp.ProcessContext) -> None:
    """Until every rank has ended (ProcessContext.join ends the others when one fails), passing
    on the signals this process gets: left to their defaults, a SIGTERM would kill it and
    interrupt its ranks without the checkpoint a stop writes, and a SIGINT would end its wait
    while the ranks train on."""
    interrupted_at: list[float] = []

    def pass_on(signum: int) -> None:
        for process in context.processes:
            with contextlib.suppress(ProcessLookupError):  # one that has just ended
                if process.is_alive():
                    os.kill(process.pid, signum)

    def on_signal(signum: int, frame) -> None:
        if signum == signal.SIGINT:  # passed on below, after the grace
            interrupted_at.append(time.monotonic())
        else:
            pass_on(signum)

    # A SIGINT ignored from the start (a background job of a script) stays so: the ranks
    # inherit that too.
    ignored = signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    with contextlib.ExitStack() as handlers:
        for signum in PASSED_ON if ignored else (*PASSED_ON, signal.SIGINT):
            handlers.callback(signal.signal, signum, signal.signal(signum, on_signal))
        interrupt_passed = False
        while not context.join(timeout=0.5):
            late = interrupted_at and time.monotonic() - interrupted_at[0] > INTERRUPT_GRACE_S
            if late and not interrupt_passed:
                pass_on(signal.SIGINT)
                interrupt_passed = True
