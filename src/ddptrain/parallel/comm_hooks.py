"""DDP gradient communication hooks (torch's ddp_comm_hooks) and PowerSGD's checkpointed state.

bf16 and fp16 compression halve the bytes of each all-reduce; PowerSGD sends a low-rank
approximation of each gradient matrix and keeps the rest as error feedback for the next step.
All three run on gloo and NCCL (`batched_powerSGD_hook` is broken on gloo and is not offered).

PowerSGD on gloo runs with one bucket (parallelize.py): with several, the ranks issue its
chained all-reduces in different orders. Its state (step count, generator, low-rank memories,
each rank's error feedback) is checkpointed, so that `--resume` of a powersgd run continues it
bitwise (tests/e2e/test_comm_hook_cli.py). The memories and the error feedback are flat tensors
in the order of the bucket's parameters; parallelize.lay_out_buckets fixes that order before
training, so a resumed run meets the order its state was saved in. The state records the order
and forgets a bucket's part should it ever meet another (a DDP wrapped without lay_out_buckets):
fed as it was, it would mix up the parameters' errors and memories. Where the state was saved in
several buckets (NCCL), the first step after a resume all-reduces plainly
(PowerSGDCheckpoint.load_state_dict): close to the uninterrupted run, not bitwise.
"""

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
from torch.distributed.checkpoint.stateful import Stateful
from torch.nn.parallel import DistributedDataParallel

from ddptrain.distributed.collectives import gather_objects
from ddptrain.distributed.env import DistEnv

HOOKS = ("none", "bf16", "fp16", "powersgd")


class LaidOutPowerSGDState(powersgd.PowerSGDState):
    """torch's PowerSGDState, which also records in which parameter order each bucket's error
    feedback and memories are laid out (`layouts`: bucket index -> parameter indices). It
    serves `--resume` of a `--ddp-comm-hook powersgd` run, which continues bitwise."""

    __slots__ = ("index", "layouts")

    def __init__(self, parameters: list[torch.Tensor], **kwargs):
        super().__init__(**kwargs)
        self.index = {p: i for i, p in enumerate(parameters)}
        self.layouts: dict[int, list[int]] = {}

    def follow(self, bucket: dist.GradBucket) -> None:
        """Forgets the bucket's state if it was laid out in another parameter order than the
        bucket's now (the hook makes it anew). Only the steps that compress read the state."""
        if self.iter < self.start_powerSGD_iter:
            return
        b, order = bucket.index(), [self.index[p] for p in bucket.parameters()]
        if self.layouts.setdefault(b, order) != order:
            for kept in (self.error_dict, self.p_memory_dict, self.q_memory_dict):
                kept.pop(b, None)
            self.layouts[b] = order

    def forget(self) -> None:
        """Starts the error feedback and the low-rank memories over: a step dropped for
        non-finite gradients fed them in, and they would pass them on to every later step. The
        hook makes them anew, its random start drawn from a generator equal on every rank."""
        for kept in (self.error_dict, self.p_memory_dict, self.q_memory_dict):
            kept.clear()


def register(
    model: DistributedDataParallel, hook: str, rank: int, start_step: int
) -> LaidOutPowerSGDState | None:
    """Registers `hook` on the DDP model; returns PowerSGD's state (to checkpoint) or None."""
    assert hook in HOOKS, hook
    if hook == "bf16":
        model.register_comm_hook(None, default_hooks.bf16_compress_hook)
    elif hook == "fp16":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif hook == "powersgd":
        state = LaidOutPowerSGDState(
            list(model.parameters()),
            process_group=None,
            matrix_approximation_rank=rank,
            # counted in synchronised backwards: one per optimizer step, accumulation or not
            start_powerSGD_iter=start_step,
        )
        model.register_comm_hook(state, laid_out_powersgd_hook)
        return state
    return None


def laid_out_powersgd_hook(
    state: LaidOutPowerSGDState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    state.follow(bucket)
    return powersgd.powerSGD_hook(state, bucket)


class PowerSGDCheckpoint(Stateful):
    """PowerSGD's state as plain tensors and numbers, so resume continues it exactly.

    The low-rank memories (P, Q) are the same on every rank after their all-reduce; the error
    feedback is each rank's own, so every rank's is gathered into the checkpoint and each rank
    takes its own back. Resumed on another number of ranks, the error feedback starts from zero
    (the memories and the step count carry over).
    """

    def __init__(self, state: LaidOutPowerSGDState, env: DistEnv):
        self.state, self.env = state, env

    def state_dict(self) -> dict:
        """A collective: every rank's error feedback goes to rank 0."""
        s = self.state
        errors = gather_objects({k: v.cpu() for k, v in s.error_dict.items()}, self.env)
        name, keys, position, has_gauss, cached = s.rng.get_state()
        return {
            "iter": s.iter,
            "rng": {
                "name": name,
                "keys": torch.from_numpy(keys.astype(np.int64)),
                "position": int(position),
                "has_gauss": int(has_gauss),
                "cached_gaussian": float(cached),
            },
            "p_memory": {k: v.cpu() for k, v in s.p_memory_dict.items()},
            "q_memory": {k: v.cpu() for k, v in s.q_memory_dict.items()},
            "errors_by_rank": errors,  # None on ranks other than 0
            "layouts": {k: torch.tensor(v) for k, v in s.layouts.items()},
        }

    def load_state_dict(self, saved: dict) -> None:
        s, device = self.state, self.env.device
        s.iter = int(saved["iter"])
        s.layouts = {int(k): v.tolist() for k, v in saved.get("layouts", {}).items()}
        if len(s.layouts) != 1:
            # A state saved without its layouts cannot be checked against the buckets; one saved
            # in several buckets (NCCL, gradients over 1 MB) is untested. That step all-reduces
            # plainly, as PowerSGD itself does before start_powerSGD_iter, and the saved state
            # goes on from the next (where a bucket's order differs, `follow` forgets it).
            s.start_powerSGD_iter = max(s.start_powerSGD_iter, s.iter + 1)
        rng = saved["rng"]
        keys = rng["keys"].numpy().astype(np.uint32)
        s.rng.set_state(
            (rng["name"], keys, rng["position"], rng["has_gauss"], rng["cached_gaussian"])
        )
        s.p_memory_dict = {int(k): v.to(device) for k, v in saved["p_memory"].items()}
        s.q_memory_dict = {int(k): v.to(device) for k, v in saved["q_memory"].items()}
        errors = saved["errors_by_rank"] or []
        mine = errors[self.env.rank] if len(errors) == self.env.world_size else {}
        s.error_dict = {int(k): v.to(device) for k, v in mine.items()}
