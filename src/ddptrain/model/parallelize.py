"""The one place that decides how the model is spread over the ranks: ddp or fsdp.

ddp keeps a whole copy of the model, its gradients and optimizer state on every rank and
all-reduces gradients; fsdp (FSDP2) shards all three and gathers each block just in time (see
model/fsdp.py). One rank runs the plain model under either: there is nothing to shard.
"""

import contextlib
import warnings

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

from ddptrain.dist.collectives import broadcast_module
from ddptrain.dist.env import DistEnv
from ddptrain.model import fsdp

STRATEGIES = ("ddp", "fsdp")


def wrap(
    model: nn.Module,
    env: DistEnv,
    gpu_pinned: bool = False,
    strategy: str = "ddp",
    arch: str = "",
    amp_dtype: torch.dtype | None = None,
    offload: bool = False,
    reshard_after_forward: bool = True,
) -> nn.Module:
    """The model, placed on env.device already, wrapped for `strategy`. Build the optimizer on
    what this returns: under fsdp its parameters are the shards.

    ddp: DDP with two or more ranks, on CPU as well as GPU; DataParallel as the classic example
    does for one process on several GPUs. A collective with two or more ranks.
    """
    assert strategy in STRATEGIES, strategy
    if env.distributed and strategy == "fsdp":
        # Each rank built its own initial weights; FSDP2 keeps each rank's slice of its own.
        broadcast_module(model, env)
        return fsdp.shard(model, arch, amp_dtype, offload, reshard_after_forward, env.device)
    if env.distributed:
        device_ids = None if env.device.type == "cpu" else [env.device.index]
        # Gradients as views into the all-reduce buckets: one copy less per step.
        return DistributedDataParallel(model, device_ids=device_ids, gradient_as_bucket_view=True)
    if env.device.type == "cuda" and not gpu_pinned and torch.cuda.device_count() > 1:
        warnings.warn(
            "one process on several GPUs: using DataParallel, which is slower than DDP; "
            "launch with `torchrun --nproc-per-node N -m ddptrain train ...` instead",
            stacklevel=2,
        )
        return nn.DataParallel(model)
    return model


@contextlib.contextmanager
def no_gradient_sync(model: nn.Module):
    """Backward without reducing gradients over the ranks: for all but the last micro-batch of
    an accumulated step, whose backward then reduces the sum once."""
    if isinstance(model, DistributedDataParallel):
        with model.no_sync():
            yield
    elif isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        yield


def is_sharded(model: nn.Module) -> bool:
    return isinstance(unwrap(model), FSDPModule)


def unwrap(model: nn.Module) -> nn.Module:
    """The module under DDP / DataParallel / torch.compile, whose state dict has no prefixes.
    (FSDP2 wraps in place: the module is its own unwrapped self.)"""
    while True:
        if isinstance(model, (DistributedDataParallel, nn.DataParallel)):
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            return model
