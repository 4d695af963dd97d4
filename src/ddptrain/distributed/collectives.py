"""Collectives for setup and agreement: every rank calls them, and a failure on any rank is
raised on every rank instead of leaving the others waiting."""

from collections.abc import Callable

import torch
import torch.distributed as dist

from ddptrain.distributed.env import DistEnv
from ddptrain.errors import UserError


def all_sum(tensor: torch.Tensor, env: DistEnv) -> torch.Tensor:
    """Sum of tensor over ranks, in place; a no-op on one process."""
    if env.distributed:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def gather_objects(value: object, env: DistEnv) -> list | None:
    """Every rank's value (picklable; CPU tensors included) as a list by rank on rank 0, None
    elsewhere. On the CPU group where there is one: nothing here needs the device."""
    if not env.distributed:
        return [value]
    gathered = [None] * env.world_size if env.is_main else None
    dist.gather_object(value, gathered, dst=0, group=env.cpu_group)
    return gathered


def start_max_on_cpu(flag: torch.Tensor, env: DistEnv) -> dist.Work:
    """Starts an in-place max of a small CPU tensor over the ranks and returns at once; wait()
    on the result before reading flag. It runs on the CPU group when the default group is a
    device backend, so reading the flag never waits for the device's queue."""
    return dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=env.cpu_group, async_op=True)


def _comm_device(env: DistEnv) -> torch.device:
    return env.device if dist.get_backend() != "gloo" else torch.device("cpu")


def agree(env: DistEnv, action: Callable[[], object], doing: str = "setting up") -> object:
    """action() on every rank; a UserError on any rank is raised on every rank.

    For setup steps that only some ranks may fail (a file missing on one node, an unwritable
    out-dir on rank 0): without this, the ranks that passed would wait forever for the others
    in their next collective.
    """
    result, error = None, None
    try:
        result = action()
    except Exception as err:  # any failure, a bug included: the others must not wait for us
        error = err
    if env.distributed:
        failed = torch.tensor([int(error is not None)], device=_comm_device(env))
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)
        if failed.item() and error is None:
            raise UserError(f"another rank failed while {doing}; its output says why")
    if error is not None:
        raise error
    return result


def from_rank0(env: DistEnv, decide: Callable[[], object]) -> object:
    """Rank 0's decide() on every rank (a small picklable value), or its UserError everywhere.

    For decisions that must be the same on every rank, such as which checkpoint to resume.
    """
    box, error = [None, None], None
    if env.is_main:
        try:
            box[0] = decide()
        except Exception as err:  # any failure: the others must not wait for rank 0
            error, box[1] = err, f"rank 0 failed: {err}"
    if env.distributed:
        dist.broadcast_object_list(box, src=0)
    if error is not None:
        raise error
    if box[1] is not None:
        raise UserError(box[1])
    return box[0]


def gather_from_all(env: DistEnv, value: object) -> list:
    """Every rank's value (small and picklable), on every rank, in rank order."""
    if not env.distributed:
        return [value]
    values = [None] * env.world_size
    dist.all_gather_object(values, value)
    return values


def check_same(
    env: DistEnv, facts: dict, fix: str = "every node must read the same data and checkpoint"
) -> None:
    """Every rank must hold rank 0's facts (data sizes, classes, resumed epoch): ranks that read
    different copies of the data or of a checkpoint would run different numbers of steps.
    `fix` ends the error."""
    reference = from_rank0(env, lambda: facts)

    def compare() -> None:
        differ = [name for name in facts if facts[name] != reference[name]]
        if differ:
            raise UserError(f"rank {env.rank} sees other {', '.join(differ)} than rank 0: {fix}")

    agree(env, compare)


def broadcast_buffers(module: torch.nn.Module, env: DistEnv) -> None:
    """Rank 0's buffers (BatchNorm running statistics) on every rank.

    DDP broadcasts them at the start of each training forward, but every rank then updates its
    own copy with its own batch: without this, each rank would evaluate its val shard with
    different statistics, and none with those of the model rank 0 saves.
    """
    if env.distributed:
        for buffer in module.buffers():
            dist.broadcast(buffer, src=0)


def rank0_first(env: DistEnv, fetch: Callable[[], object]) -> object:
    """fetch() on rank 0, then on the others: for a download one process should do.

    A failure on any rank ends every rank. Ranks on other nodes fetch after rank 0, at the
    same time as each other.
    """
    first = agree(env, fetch) if env.is_main else agree(env, lambda: None)
    return agree(env, lambda: first if env.is_main else fetch())
