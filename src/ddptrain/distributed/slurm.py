"""Started by `srun` directly (one task per device, no torchrun): the placement SLURM gives.

srun sets, for each task of its job step, SLURM_PROCID (global rank), SLURM_LOCALID (rank on the
node), SLURM_STEP_NUM_TASKS (world size), SLURM_STEP_TASKS_PER_NODE (ranks per node),
SLURM_STEP_NODELIST (the step's hosts, compressed) and SLURM_STEP_ID. The step's variables, not
the job's: a batch script's own process also carries SLURM_PROCID 0 and the job's SLURM_NTASKS
but is one process, and two steps of one job may run at once on parts of its nodes. Rank 0 runs
on the first host of the step, which is where the ranks meet; MASTER_ADDR and MASTER_PORT win
when set.
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
    """srun started several tasks of ddptrain (not one task running torchrun, nor a batch
    script's own process, which has no step of its own)."""
    needed = ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_STEP_NUM_TASKS")
    return all(name in environ for name in needed) and int(environ["SLURM_STEP_NUM_TASKS"]) > 1


def expand_nodelist(nodelist: str, variable: str = "SLURM_STEP_NODELIST") -> list[str]:
    """The hosts of a SLURM nodelist, in order, as `scontrol show hostnames` gives them:
    `a,b`, `node[01-03,07]` (zero padding kept), `rack[1-2]-n[1-2]`, and mixtures of these.
    Written here because ranks must not depend on scontrol being installed on compute nodes."""
    hosts = []
    for name in _split_top_level(nodelist, variable):
        expanded = [""]
        for literal, ranges in re.findall(r"([^\[]*)(?:\[([^\]]*)\])?", name):
            numbers = _expand_ranges(ranges, nodelist, variable) if ranges else [""]
            choices = [literal + n for n in numbers]
            expanded = [head + tail for head in expanded for tail in choices]
        hosts += [h for h in expanded if h]
    return hosts


def _split_top_level(nodelist: str, variable: str) -> list[str]:
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
        raise UserError(f"{variable}: unbalanced brackets in {nodelist!r}")
    return [p for p in [*parts, current] if p]


def _expand_ranges(ranges: str, nodelist: str, variable: str) -> list[str]:
    numbers = []
    for item in ranges.split(","):
        low, _, high = item.partition("-")
        if not low.isdigit() or (high and not high.isdigit()):
            raise UserError(f"{variable}: cannot read {item!r} in {nodelist!r}")
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
    counts = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE")
    if counts is not None:
        per_node = tasks_per_node(counts)
        local_world = per_node[min(int(environ.get("SLURM_NODEID", 0)), len(per_node) - 1)]
    else:
        local_world = int(environ.get("SLURM_NTASKS_PER_NODE", 1))
    if environ.get("MASTER_ADDR"):
        addr = environ["MASTER_ADDR"]
    else:
        variable = next(
            (name for name in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST") if environ.get(name)),
            "SLURM_STEP_NODELIST",
        )
        hosts = expand_nodelist(environ.get(variable, ""), variable)
        if not hosts:
            raise UserError(f"srun: {variable} names no host; set MASTER_ADDR to rank 0's host")
        addr = hosts[0]
    if "MASTER_PORT" in environ:
        port = int(environ["MASTER_PORT"])
    else:  # steps of one job that run at once meet at ports of their own
        job, step = (int(environ.get(name, 0)) for name in ("SLURM_JOB_ID", "SLURM_STEP_ID"))
        port = PORT_BASE + (job + 1000 * step) % PORT_SPAN
    return SlurmPlacement(
        rank=int(environ["SLURM_PROCID"]),
        world_size=int(environ["SLURM_STEP_NUM_TASKS"]),
        local_rank=int(environ["SLURM_LOCALID"]),
        local_world_size=local_world,
        master_addr=addr,
        master_port=port,
    )
