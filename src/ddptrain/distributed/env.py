"""The only module that reads launcher environment variables or touches process groups.

Every launcher ends in one `DistEnv`: torchrun and torch.distributed.launch (RANK, WORLD_SIZE,
LOCAL_RANK), srun without torchrun (SLURM_PROCID and the rest, read in slurm.py),
--multiprocessing-distributed (a `SpawnSlot` from launch.py), --dist-url tcp:// with
--world-size/--rank (one process per invocation), or a single process.
"""

import datetime
import os
import socket
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ddptrain.config import LaunchSettings
from ddptrain.distributed import slurm
from ddptrain.distributed.threads import share_cpu_threads
from ddptrain.errors import UserError, first_line


@dataclass(frozen=True)
class SpawnSlot:
    """Where one --multiprocessing-distributed process sits: node and local index."""

    local_rank: int
    nproc_per_node: int
    node_rank: int
    nodes: int
    dist_url: str


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    # For small CPU-side agreements (stop requests) when the default group is a device
    # backend: a flag reduced there would wait for the device. None: the default group is gloo.
    cpu_group: dist.ProcessGroup | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def _placement(launch: LaunchSettings, slot: SpawnSlot | None) -> tuple[int, int, int, int, str]:
    """(rank, world_size, local_rank, local_world_size, init url) for this process."""
    env = os.environ
    if slot is not None:
        rank = slot.node_rank * slot.nproc_per_node + slot.local_rank
        world = slot.nodes * slot.nproc_per_node
        return rank, world, slot.local_rank, slot.nproc_per_node, slot.dist_url
    if launch.dist_url == "env://" and "WORLD_SIZE" in env:  # torchrun, torch.distributed.launch
        if "RANK" not in env:
            raise UserError("WORLD_SIZE is set but RANK is not: launch with torchrun")
        local_rank = int(env.get("LOCAL_RANK", launch.local_rank or 0))
        local_world = int(env.get("LOCAL_WORLD_SIZE", 1))
        return int(env["RANK"]), int(env["WORLD_SIZE"]), local_rank, local_world, "env://"
    if launch.dist_url == "env://" and slurm.started_by_srun(env):  # srun, no torchrun
        task = slurm.placement(env)
        return task.rank, task.world_size, task.local_rank, task.local_world_size, task.url
    started_with_others = _launcher(env)
    if started_with_others and launch.world_size < 2:
        # Each process would read only its own flags and train alone, all on device 0.
        raise UserError(
            f"--dist-url {launch.dist_url}: {started_with_others} started this process with "
            "others and placed it; drop --dist-url (env://, the default, takes that placement)"
        )
    if launch.world_size > 1:  # one process per invocation, e.g. --dist-url tcp://
        if launch.rank < 0:
            raise UserError(f"--world-size {launch.world_size} needs --rank of this process")
        if launch.dist_url == "env://" and not {"MASTER_ADDR", "MASTER_PORT"} <= env.keys():
            raise UserError(
                "--dist-url env:// needs MASTER_ADDR and MASTER_PORT (torchrun sets them); "
                "launch with torchrun or give --dist-url tcp://HOST:PORT"
            )
        devices = _node_device_count(launch)
        local_rank = local_index(launch.rank, env.get("LOCAL_RANK"), launch.local_rank, devices)
        local_world = int(env.get("LOCAL_WORLD_SIZE", min(launch.world_size, devices) or 1))
        return launch.rank, launch.world_size, local_rank, local_world, launch.dist_url
    return 0, 1, 0, 1, launch.dist_url


def _launcher(env) -> str | None:
    """The launcher that started this process together with others, all with the same flags,
    and placed each (torchrun, torch.distributed.launch, srun), if one did."""
    if int(env.get("WORLD_SIZE", 1)) > 1 and "RANK" in env:
        return "a launcher (WORLD_SIZE and RANK are set)"
    if slurm.started_by_srun(env):
        return "srun"
    return None


def local_index(
    rank: int, local_rank_env: str | None, local_rank_flag: int | None, devices_per_node: int
) -> int:
    """This process's index on its node when each process was started on its own (--dist-url
    tcp:// with --rank): LOCAL_RANK, else --local-rank, else the global rank modulo the node's
    device count (ranks numbered node by node, as every launcher does), so rank 9 on 8-device
    nodes takes device 1 rather than asking for a ninth. On a CPU node, the global rank."""
    if local_rank_env is not None:
        return int(local_rank_env)
    if local_rank_flag is not None:
        return local_rank_flag
    return rank % devices_per_node if devices_per_node > 0 else rank


def _device_kind(launch: LaunchSettings) -> str:
    kind = "cpu" if launch.no_accel else launch.device
    if kind == "auto":
        accelerator = torch.accelerator.current_accelerator(check_available=True)
        kind = accelerator.type if accelerator is not None else "cpu"
    return kind


def _node_device_count(launch: LaunchSettings) -> int:
    """Accelerators of the run's kind on this node; 0 on CPU (or with none available)."""
    kind = _device_kind(launch)
    module = getattr(torch, kind, None)
    if kind == "cpu" or module is None or not module.is_available():
        return 0
    return module.device_count()


def _device(launch: LaunchSettings, local_rank: int) -> torch.device:
    kind = _device_kind(launch)
    if kind == "cpu" and launch.gpu is not None:
        raise UserError(f"--gpu {launch.gpu}: no accelerator is available here")
    if kind == "cpu":
        return torch.device("cpu")
    module = getattr(torch, kind)
    if not module.is_available():
        raise UserError(f"--device {kind}: no {kind} device is available here")
    count = module.device_count()
    if launch.gpu is not None:
        index = launch.gpu
    elif local_rank < count:
        index = local_rank
    else:
        raise UserError(
            f"local rank {local_rank} has no {kind} device of its own (this node has {count}); "
            "start at most one process per device, or pin one with --gpu"
        )
    if index >= count:
        raise UserError(f"--gpu {index}: this node has {count} {kind} device(s)")
    return torch.device(kind, index)


def _restart_safe_store(
    url: str, timeout: datetime.timedelta, rank: int, say: Callable[[str], None] | None
) -> dist.Store | None:
    """Under torchrun, a store the workers of one restart attempt share with no other attempt.

    torchrun shares its rendezvous store with the workers and keeps it across restarts
    (pytorch/pytorch#135712), so a restarted process group can read the dead attempt's peer
    addresses and fail to connect, or hang. On one node every worker has the same restart count:
    prefixing keys with it separates the attempts. Across nodes the counts can differ; there
    docs/faults.md says to run torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (a fresh store
    per attempt): this returns None there and, with restarts on, says so on rank 0.
    """
    shared = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    if url != "env://" or not shared:
        return None
    if os.environ.get("GROUP_WORLD_SIZE", "1") != "1":
        if os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") != "0" and rank == 0 and say:
            say(
                "warning: torchrun --max-restarts across nodes can hang on restart unless "
                "torchrun runs with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (see the README)"
            )
        return None
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout
    )
    return dist.PrefixStore(f"ddptrain/attempt_{os.environ['TORCHELASTIC_RESTART_COUNT']}", store)


_FAILED, _ARRIVED, _SEEN = "ddptrain/failed_before_group", "ddptrain/arrived", "ddptrain/seen"
_HOSTS = "ddptrain/ranks_on_host"


def _tcp_store(url: str, rank: int, world: int, timeout: datetime.timedelta) -> dist.Store | None:
    """The store a --dist-url tcp://HOST:PORT rendezvous would make (rank 0 hosts it)."""
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme != "tcp" or parsed.hostname is None or parsed.port is None:
        return None
    try:
        return dist.TCPStore(
            parsed.hostname,
            parsed.port,
            world,
            is_master=rank == 0,
            timeout=timeout,
            wait_for_workers=False,
        )
    except (RuntimeError, OSError) as err:
        raise UserError(
            f"--dist-url {url}: cannot reach the rendezvous ({first_line(err)})"
        ) from None


def _announce_failure(store: dist.Store, rank: int, world: int, err: Exception) -> None:
    """Tells the ranks meeting in store why this one will not come; rank 0, whose process holds
    the store, waits up to a few seconds for them to read it."""
    try:
        store.set(_FAILED, f"rank {rank}: {first_line(err)}")
        deadline = time.monotonic() + 5
        while rank == 0 and store.add(_SEEN, 0) < world - 1 and time.monotonic() < deadline:
            time.sleep(0.1)
    except Exception:  # the store is gone too: the others find out at their timeout
        pass


def _meet(store: dist.Store, rank: int, world: int, timeout: datetime.timedelta) -> int:
    """Waits until every rank arrived, or one said it failed (then fails too, naming it).
    Returns how many of the ranks run on this host (by host name): they share its cores."""
    on_this_host = f"{_HOSTS}/{socket.gethostname()}"
    store.add(on_this_host, 1)  # before arriving: every count is complete once all arrived
    store.add(_ARRIVED, 1)
    deadline = time.monotonic() + timeout.total_seconds()
    while store.add(_ARRIVED, 0) < world:
        if store.check([_FAILED]):
            failed = store.get(_FAILED).decode()
            store.add(_SEEN, 1)
            raise UserError(f"{failed} (before the process group formed)")
        if time.monotonic() > deadline:
            raise UserError(
                f"--dist-url: {world - store.add(_ARRIVED, 0)} of {world} ranks did not arrive "
                f"within --dist-timeout ({timeout.total_seconds():.0f} s)"
            )
        time.sleep(0.1)
    return store.add(on_this_host, 0)


def _backend(launch: LaunchSettings, device: torch.device) -> str:
    backend = launch.dist_backend or dist.get_default_backend_for_device(device.type)
    if backend == "nccl" and device.type != "cuda":
        raise UserError(f"--dist-backend nccl needs CUDA devices; this run is on {device.type}")
    return backend


def init_distributed(
    launch: LaunchSettings,
    workers: int,
    slot: SpawnSlot | None = None,
    say: Callable[[str], None] | None = None,
) -> DistEnv:
    """This process's place in the run, its process group formed; `workers`: its loader
    workers (-j), which share the node's CPU threads with it. `say(line)`: how rank 0 shows a
    warning found on the way, before the group forms (a restart can hang there) and before any
    Reporter exists; run.train passes progress.say. None: nothing is shown."""
    rank, world, local_rank, local_world, url = _placement(launch, slot)
    timeout = datetime.timedelta(seconds=launch.dist_timeout)
    # Under --dist-url tcp:// no launcher ends the other invocations when one fails: the ranks
    # meet in a store first, where a rank that fails before the group forms says so.
    meeting = _tcp_store(url, rank, world, timeout) if world > 1 else None
    try:
        # Processes a launcher started share the flags; one started on its own may pin its own.
        if launch.gpu is not None and local_world > 1 and (slot or _launcher(os.environ)):
            raise UserError(
                f"--gpu {launch.gpu} would put all {local_world} processes of this node on one "
                "device; drop it: each rank takes the device of its local rank"
            )
        device = _device(launch, local_rank)
        if device.type != "cpu":
            torch.accelerator.set_device_index(device.index)
        backend = _backend(launch, device) if world > 1 else None
    except Exception as err:
        if meeting is not None:
            _announce_failure(meeting, rank, world, err)
        raise
    if meeting is not None:
        on_this_host = _meet(meeting, rank, world, timeout)
        # Processes started one by one know nothing of each other but what the meeting says.
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", on_this_host))
    share_cpu_threads(local_world, workers)
    cpu_group = None
    if world > 1:
        store = meeting or _restart_safe_store(url, timeout, rank, say)
        rendezvous = {"init_method": url} if store is None else {"store": store}
        dist.init_process_group(backend, world_size=world, rank=rank, timeout=timeout, **rendezvous)
        if backend != "gloo":
            cpu_group = dist.new_group(backend="gloo", timeout=timeout)
    return DistEnv(rank, world, local_rank, local_world, device, cpu_group)


def teardown_distributed() -> None:
    """Ends the default process group and every group made from it (the CPU group too)."""
    if dist.is_initialized():
        dist.destroy_process_group()
        # A finished run exits 0, not SIGABRT: gloo threads still dropping tensors as the
        # interpreter finalizes get this pause with the GIL released (docs/faults.md, test_exit).
        time.sleep(0.1)
