"""Wrap the model for data parallelism, and unwrap it for saving and evaluation."""

import warnings

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddptrain.dist.env import DistEnv


def wrap(model: nn.Module, env: DistEnv, gpu_pinned: bool) -> nn.Module:
    """DDP with two or more ranks, on CPU as well as GPU; DataParallel as the classic example does
    for one process on several GPUs."""
    model = model.to(env.device)
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


def unwrap(model: nn.Module) -> nn.Module:
    """The plain module under DDP / DataParallel / torch.compile: its state dict has no prefixes."""
    while True:
        if isinstance(model, (DistributedDataParallel, nn.DataParallel)):
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            return model
