"""CPU threads: how many intra-op threads each rank takes on a shared node."""

import os
from collections.abc import Collection, Mapping
from pathlib import Path

import torch


def cpu_threads(cores: int, local_world_size: int, workers: int) -> int:
    """Intra-op threads for one rank: its share of the node's cores, less what its loader
    workers take.

    The workers' part is capped at a quarter of the share: on a CPU run the model's math is
    the bottleneck and a worker mostly waits on a full prefetch queue (decoding is a few ms an
    image), while on a GPU run the rank's own threads matter little.
    """
    share = max(1, cores // local_world_size)
    return max(1, share - min(workers, share // 4))


def user_set_threads(environ: Mapping[str, str], launcher_env: Collection[str] | None) -> bool:
    """Whether OMP_NUM_THREADS is the user's choice, given the names in the launcher's own
    start-up environment (None: not known).

    torchrun (and torch.distributed.launch) sets OMP_NUM_THREADS=1 for its workers when it
    starts several and the variable is unset, which leaves all but one core per rank idle on a
    CPU run with fewer ranks than cores. Its workers see the same value a user could have set;
    torchrun's start-up environment tells them apart, as torchrun sets the variable later.
    """
    if "OMP_NUM_THREADS" not in environ:
        return False
    torchrun_default = (
        "TORCHELASTIC_RUN_ID" in environ
        and environ["OMP_NUM_THREADS"] == "1"
        and launcher_env is not None
        and "OMP_NUM_THREADS" not in launcher_env
    )
    return not torchrun_default


def _launcher_env() -> set[str] | None:
    """Names in the parent process's (torchrun's) environment as it started: /proc/PID/environ
    keeps the start-up block, whatever the process later put in os.environ. None without /proc."""
    try:
        raw = Path(f"/proc/{os.getppid()}/environ").read_bytes()
    except OSError:
        return None
    return {entry.split(b"=", 1)[0].decode(errors="replace") for entry in raw.split(b"\0") if entry}


def usable_cores() -> int:
    """The cores this process may run on (its affinity, where the system has one)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return cores or 1


def share_cpu_threads(local_world_size: int, workers: int) -> None:
    """Ranks on one node share its usable cores, unless the user chose OMP_NUM_THREADS."""
    launcher_env = _launcher_env() if "TORCHELASTIC_RUN_ID" in os.environ else None
    if not user_set_threads(os.environ, launcher_env):
        torch.set_num_threads(cpu_threads(usable_cores(), local_world_size, workers))


def too_many_workers(workers: int, local_world_size: int, cores: int) -> str | None:
    """Rank 0's warning when the loader workers of this node's ranks outnumber its cores: said
    once for the node, where torch's own warning came from every rank as each loader started
    (data/loaders.py silences that one)."""
    total = workers * local_world_size
    if total <= cores:
        return None
    return (
        f"-j {workers}: {total} loader workers for the {local_world_size} rank(s) on this node, "
        f"which has {cores} cores; if the progress shows time waiting for data, lower -j"
    )
