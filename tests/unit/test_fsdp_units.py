"""fsdp's unit rule on models it has no block for (no process group needed: it refuses first)."""

import pytest
import torch
from torch import nn

from ddptrain.config import Config
from ddptrain.distributed.env import DistEnv
from ddptrain.errors import UserError
from ddptrain.parallel.fsdp import shard, shard_units
from ddptrain.resolve import check_offload_clipping


class ParametersOnTheRoot(nn.Module):
    """A model whose only parameter sits on the root: nothing for fsdp to make a unit of."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3))
        self.pool = nn.AdaptiveAvgPool2d(1)

    def forward(self, x):
        return self.pool(x).flatten(1) * self.scale


def test_a_model_without_units_is_refused_with_the_way_out():
    assert shard_units(ParametersOnTheRoot()) == []
    with pytest.raises(UserError, match="no blocks to shard in --arch custom; use --strategy ddp"):
        shard(ParametersOnTheRoot(), "custom")


def test_a_plain_stack_shards_by_its_children():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.LazyLinear(2))
    assert [type(u).__name__ for u in shard_units(model)] == ["Conv2d", "LazyLinear"]


def test_clipping_offloaded_gradients_on_a_gpu_is_refused_before_anything_starts():
    """torch's clip_grad_norm_ sums the offloaded shards' norms over NCCL, which takes no
    host-memory tensor: every rank would fail at the first step."""
    gpus = DistEnv(0, 2, 0, 2, torch.device("cuda", 0))
    clipped = Config(strategy="fsdp", fsdp_offload=True, clip_grad_norm=1.0)
    with pytest.raises(UserError, match="--clip-grad-norm does not run with --fsdp-offload"):
        check_offload_clipping(clipped, gpus)
    check_offload_clipping(Config(strategy="fsdp", fsdp_offload=True), gpus)
    check_offload_clipping(clipped, DistEnv(0, 2, 0, 2, torch.device("cpu")))  # gloo's group
