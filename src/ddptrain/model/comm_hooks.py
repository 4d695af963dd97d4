"""DDP gradient communication hooks (torch's ddp_comm_hooks) and PowerSGD's checkpointed state.

bf16 and fp16 compression halve the bytes of each all-reduce; PowerSGD sends a low-rank
approximation of each gradient matrix and keeps the rest as error feedback for the next step.
All three run on gloo and NCCL (measured on gloo with torch 2.14; `batched_powerSGD_hook` is
broken there and is not offered).

PowerSGD on gloo runs with one bucket (parallelize.py): with several, the ranks issued its
chained all-reduces in different orders. Its state (step count, generator, low-rank memories,
each rank's error feedback) is checkpointed and restored exactly, but a resumed run is not
bitwise the uninterrupted one. The saved memories and error feedback are flat tensors laid out
in the bucket order DDP builds after a process's first step (the gradients' ready order); the
first step of a new process has another order. Fed the saved state, that step mixes up the
parameters' errors and memories, and training goes non-finite within two steps. So the first
step after a resume is a plain all-reduce (what PowerSGD itself does before
start_powerSGD_iter, for the same reason), and PowerSGD goes on from the next step with the
saved state. find_unused_parameters would keep the first layout, but its extra all-reduce
interleaves with PowerSGD's on gloo and mismatches.
"""

import numpy as np
import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
from torch.distributed.checkpoint.stateful import Stateful
from torch.nn.parallel import DistributedDataParallel

from ddptrain.dist.collectives import gather_objects
from ddptrain.dist.env import DistEnv

HOOKS = ("none", "bf16", "fp16", "powersgd")


def register(
    model: DistributedDataParallel, hook: str, rank: int, start_step: int
) -> powersgd.PowerSGDState | None:
    """Registers `hook` on the DDP model; returns PowerSGD's state (to checkpoint) or None."""
    assert hook in HOOKS, hook
    if hook == "bf16":
        model.register_comm_hook(None, default_hooks.bf16_compress_hook)
    elif hook == "fp16":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif hook == "powersgd":
        state = powersgd.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=rank,
            # counted in synchronised backwards: one per optimizer step, accumulation or not
            start_powerSGD_iter=start_step,
        )
        model.register_comm_hook(state, powersgd.powerSGD_hook)
        return state
    return None


class PowerSGDCheckpoint(Stateful):
    """PowerSGD's state as plain tensors and numbers, so resume continues it exactly.

    The low-rank memories (P, Q) are the same on every rank after their all-reduce; the error
    feedback is each rank's own, so every rank's is gathered into the checkpoint and each rank
    takes its own back. Resumed on another number of ranks, the error feedback starts from zero
    (the memories and the step count carry over).
    """

    def __init__(self, state: powersgd.PowerSGDState, env: DistEnv):
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
        }

    def load_state_dict(self, saved: dict) -> None:
        s, device = self.state, self.env.device
        s.iter = int(saved["iter"])
        # This process's first step has DDP's first bucket layout, not the saved state's: it
        # all-reduces plainly, and its iter count brings PowerSGD back from the next step.
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
