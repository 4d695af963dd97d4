"""DDP gradient communication hooks (torch's ddp_comm_hooks) and PowerSGD's checkpointed state.

bf16 and fp16 compression halve the bytes of each all-reduce; PowerSGD sends a low-rank
approximation of each gradient matrix and keeps the rest as error feedback for the next step.
All three run on gloo and NCCL (`batched_powerSGD_hook` is broken on gloo and is not offered).

PowerSGD on gloo runs with one bucket (parallelize.py): with several, the ranks issue its
chained all-reduces in different orders. Its state (step count, generator, low-rank memories,
each rank's error feedback) is checkpointed, so a resumed run is bitwise the uninterrupted one.
The memories and the error feedback are flat tensors laid out in the order of the bucket's
parameters, and that order can change: DDP builds a process's first bucket in the parameters'
order and rebuilds it, after the first backward, in the order their gradients became ready.
ddptrain has that rebuild done before training (parallelize.lay_out_buckets), so a run's hook
meets one layout from its first step on; a DDP wrapped without it (as some tests do) meets the
change at its second step, where a state fed as it was would mix up the parameters' errors and
memories. So the state remembers the parameter order it was written in, is checkpointed with
it, and is moved into the bucket's order whenever that changes. Where the state was saved in
several buckets (NCCL), the first step after a resume all-reduces plainly
(PowerSGDCheckpoint.load_state_dict): close to the uninterrupted run, not bitwise.
find_unused_parameters would keep the first layout, but its extra all-reduce interleaves with
PowerSGD's on gloo and mismatches.
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
    """torch's PowerSGDState, which also knows in which parameter order each bucket's error
    feedback and memories are laid out (`layouts`: bucket index -> parameter indices)."""

    __slots__ = ("index", "shapes", "layouts")

    def __init__(self, parameters: list[torch.Tensor], **kwargs):
        super().__init__(**kwargs)
        self.index = {p: i for i, p in enumerate(parameters)}
        self.shapes = [p.shape for p in parameters]
        self.layouts: dict[int, list[int]] = {}

    def follow(self, bucket: dist.GradBucket) -> None:
        """Moves the bucket's state into the bucket's present parameter order. Only the steps
        that compress read and write the state: a plain all-reduce step leaves it as it is."""
        if self.iter < self.start_powerSGD_iter:
            return
        b, order = bucket.index(), [self.index[p] for p in bucket.parameters()]
        was = self.layouts.get(b, order)
        if was != order:
            assert sorted(was) == sorted(order), f"DDP moved parameters into bucket {b}"
            if b in self.error_dict:
                numels = [(i, self.shapes[i].numel()) for i in was]
                self.error_dict[b] = _reorder(self.error_dict[b], numels, order)
            if b in self.p_memory_dict:
                before, after = self._memory_slots(was), self._memory_slots(order)
                now = [i for i, _, _ in after]
                p_slices, q_slices = [(i, n) for i, n, _ in before], [(i, m) for i, _, m in before]
                self.p_memory_dict[b] = _reorder(self.p_memory_dict[b], p_slices, now)
                self.q_memory_dict[b] = _reorder(self.q_memory_dict[b], q_slices, now)
        self.layouts[b] = order

    def forget(self) -> None:
        """Starts the error feedback and the low-rank memories over: a step dropped for
        non-finite gradients fed them in, and they would pass them on to every later step. The
        hook makes them anew, its random start drawn from a generator equal on every rank."""
        for kept in (self.error_dict, self.p_memory_dict, self.q_memory_dict):
            kept.clear()

    def _memory_slots(self, order: list[int]) -> list[tuple[int, int, int]]:
        """(parameter, its length in P, in Q) for each slot of the P and Q memories, in the
        order powerSGD_hook lays them out: the gradients worth compressing, viewed as matrices,
        grouped by shape in order of first appearance."""
        by_shape: dict[tuple[int, int], list[int]] = {}
        for i in order:
            n = self.shapes[i][0]
            by_shape.setdefault((n, self.shapes[i].numel() // n), []).append(i)
        slots = []
        for (n, m), group in by_shape.items():
            r = min(n, m, self.matrix_approximation_rank)
            # torch's own test, so that the slots are the ones its hook allocates
            if powersgd._should_compress(n, m, r, self.min_compression_rate)[0]:
                slots += [(i, n * r, m * r) for i in group]
        return slots


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


def _reorder(flat: torch.Tensor, slices: list[tuple[int, int]], order: list[int]) -> torch.Tensor:
    """`flat`, made of one slice per (parameter, length) of `slices`, with its slices put in
    the parameters' `order`."""
    if not slices:  # nothing in the bucket worth compressing: empty memories
        return flat
    pieces = dict(zip([i for i, _ in slices], flat.split([n for _, n in slices]), strict=True))
    return torch.cat([pieces[i] for i in order])


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
            # A state saved without its layouts cannot be moved into any bucket order; one saved
            # in several buckets (NCCL, gradients over 1 MB) cannot be moved into the single
            # bucket a DDP starts with when it was wrapped without lay_out_buckets. Under
            # ddptrain's wrap the buckets are met as saved, but several are untested: that step
            # all-reduces plainly, as PowerSGD itself does before start_powerSGD_iter, and the
            # saved state goes on from the next.
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
