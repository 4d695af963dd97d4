"""--freeze-backbone and --unfreeze-epoch on 2 real gloo ranks: the frozen backbone stays
bitwise as it was, with no optimizer state; once unfrozen, every parameter trains alike on
every rank (under ddp, DDP is built anew to reduce the backbone's gradients too)."""

import pytest
import torch
from harness import run_ranks

from ddptrain.config import ParallelSettings
from ddptrain.model.build import build_model
from ddptrain.model.providers import TORCHVISION
from ddptrain.parallel.parallelize import rewrapped, unwrap, wrap
from ddptrain.train.finetune import Freezing
from ddptrain.train.step import Step


def whole(model) -> dict[str, torch.Tensor]:
    """The state dict, fsdp's shards gathered (a collective under fsdp)."""
    state = unwrap(model).state_dict()
    return {k: getattr(v, "full_tensor", v.detach)().clone() for k, v in state.items()}


def head_only_then_all(env, strategy):
    torch.manual_seed(0)
    model = build_model("resnet18", 3, 16, False)
    freezing = Freezing(model, TORCHVISION.classifier(model), until=1)
    freezing.enter(0)
    example = torch.zeros(2, 3, 16, 16)
    wrapped = wrap(model, env, strategy=strategy, arch="resnet18", example=example)
    # every parameter, the frozen ones too, as run.py builds it
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    start = whole(wrapped)
    generator = torch.Generator().manual_seed(env.rank)  # each rank its own batch
    images, target = torch.randn(4, 3, 16, 16, generator=generator), torch.tensor([0, 1, 2, 0])
    freezing.train(wrapped)
    Step(wrapped, optimizer)(images, target)
    changed = sorted(k for k, v in whole(wrapped).items() if not v.equal(start[k]))
    states = len(optimizer.state)
    assert freezing.enter(1)
    wrapped = rewrapped(wrapped, ParallelSettings(), example, None)
    freezing.train(wrapped)
    Step(wrapped, optimizer)(images, target)
    # the parameters: each rank's running statistics are of its own batch
    names = dict(unwrap(wrapped).named_parameters())
    weights = torch.cat([v.flatten() for k, v in whole(wrapped).items() if k in names])
    return changed, states, len(optimizer.state), weights


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_frozen_backbone_is_untouched_then_trains_on_every_rank_alike(strategy):
    results = run_ranks(head_only_then_all, 2, strategy, timeout=120)
    for changed, states, states_after, _ in results:
        # BatchNorm statistics too: the backbone's norms stay in eval mode
        assert changed == ["fc.bias", "fc.weight"] and states == 2
        assert states_after == 62  # every parameter of resnet18
    (*_, a), (*_, b) = results
    assert torch.equal(a, b)  # the backbone's gradients were reduced over the ranks
