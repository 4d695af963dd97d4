"""fsdp's unit rule on models it has no block for (no process group needed: it refuses first)."""

import pytest
import torch
from torch import nn

from ddptrain.errors import UserError
from ddptrain.model.fsdp import shard, shard_units


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
