"""Started by `srun` directly (one task per device, no torchrun): the placement SLURM gives.

srun sets SLURM_PROCID (global rank), SLURM_LOCALID (rank on the node), SLURM_NTASKS (world
size), SLURM_NTASKS_PER_NODE or SLURM_TASKS_PER_NODE (ranks per node) and SLURM_JOB_NODELIST
(the job's hosts, compressed). Rank 0 runs on the first host of the list, which is where the
ranks meet; MASTER_ADDR and MASTER_PORT win when set.
"""

import re
from collections.abc import Mapping
from dataclasses import dataclass

from ddptrain.errors import UserError

# Ports derived from the job id, so two jobs sharing a node do not meet at the same port; above
# the registered range torch's examples use, below the OS's ephemeral ports (32768-).
PORT_BASE, PORT_SPAN = 12000, 20000


@dataclass(frozen=True)
class SlurmPlacement:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int

    @property
    def url(self) -> str:
        return f"tcp://{self.master_addr}:{self.master_port}"


def started_by_srun(environ: Mapping[str, str]) -> bool:
    """srun started several tasks of ddptrain (not one task running torchrun)."""
    needed = ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS", "SLURM_JOB_NODELIST")
    return all(name in environ for name in needed) and int(environ["SLURM_NTASKS"]) > 1


def expand_nodelist(nodelist: str) -> list[str]:
    """The hosts of a SLURM nodelist, in order, as `scontrol show hostnames` gives them:
    `a,b`, `node[01-03,07]` (zero padding kept), `rack[1-2]-n[1-2]`, and mixtures of these.
    Written here because ranks must not depend on scontrol being installed on compute nodes."""
    hosts = []
    for name in _split_top_level(nodelist):
        expanded = [""]
        for literal, ranges in re.findall(r"([^\[]*)(?:\[([^\]]*)\])?", name):
            numbers = _expand_ranges(ranges, nodelist) if ranges else [""]
            choices = [literal + n for n in numbers]
            expanded = [head + tail for head in expanded for tail in choices]
        hosts += [h for h in expanded if h]
    return hosts


def _split_top_level(nodelist: str) -> list[str]:
    """Splits at commas outside brackets: `a[1,3],b` -> `a[1,3]`, `b`."""
    parts, depth, current = [], 0, ""
    for char in nodelist.strip():
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    if depth != 0:
        raise UserError(f"SLURM_JOB_NODELIST: unbalanced brackets in {nodelist!r}")
    return [p for p in [*parts, current] if p]


def _expand_ranges(ranges: str, nodelist: str) -> list[str]:
    numbers = []
    for item in ranges.split(","):
        low, _, high = item.partition("-")
        if not low.isdigit() or (high and not high.isdigit()):
            raise UserError(f"SLURM_JOB_NODELIST: cannot read {item!r} in {nodelist!r}")
        width = len(low)
        numbers += [str(n).zfill(width) for n in range(int(low), int(high or low) + 1)]
    return numbers


def tasks_per_node(value: str) -> list[int]:
    """SLURM_TASKS_PER_NODE, e.g. `2(x3),1` -> [2, 2, 2, 1]."""
    counts = []
    for item in value.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if match is None:
            raise UserError(f"SLURM_TASKS_PER_NODE: cannot read {value!r}")
        counts += [int(match[1])] * int(match[2] or 1)
    return counts


def placement(environ: Mapping[str, str]) -> SlurmPlacement:
    """The placement of this task; call only when started_by_srun(environ)."""
    if "SLURM_NTASKS_PER_NODE" in environ:
        local_world = int(environ["SLURM_NTASKS_PER_NODE"])
    elif "SLURM_TASKS_PER_NODE" in environ:
        counts = tasks_per_node(environ["SLURM_TASKS_PER_NODE"])
        local_world = counts[min(int(environ.get("SLURM_NODEID", 0)), len(counts) - 1)]
    else:
        local_world = 1
    addr = environ.get("MASTER_ADDR") or expand_nodelist(environ["SLURM_JOB_NODELIST"])[0]
    if "MASTER_PORT" in environ:
        port = int(environ["MASTER_PORT"])
    else:
        port = PORT_BASE + int(environ.get("SLURM_JOB_ID", 0)) % PORT_SPAN
    return SlurmPlacement(
        rank=int(environ["SLURM_PROCID"]),
        world_size=int(environ["SLURM_NTASKS"]),
        local_rank=int(environ["SLURM_LOCALID"]),
        local_world_size=local_world,
        master_addr=addr,
        master_port=port,
    )
