"""--freeze-backbone and --unfreeze-epoch on 2 real gloo ranks under DDP: the frozen backbone
stays bitwise as it was, with no optimizer state; once unfrozen, DDP is built anew and reduces
the backbone's gradients too."""

import torch
from harness import run_ranks

from ddptrain.config import ParallelSettings
from ddptrain.model.build import build_model
from ddptrain.model.providers import TORCHVISION
from ddptrain.parallel.parallelize import rewrapped, unwrap, wrap
from ddptrain.train.finetune import Freezing
from ddptrain.train.step import Step


def head_only_then_all(env):
    torch.manual_seed(0)
    model = build_model("resnet18", 3, 16, False)
    freezing = Freezing(model, TORCHVISION.classifier(model), until=1)
    freezing.enter(0)
    example = torch.zeros(2, 3, 16, 16)
    ddp = wrap(model, env, example=example)
    params = [p for p in ddp.parameters()]  # frozen ones too, as run.py builds it
    optimizer = torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-4)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    generator = torch.Generator().manual_seed(env.rank)  # each rank its own batch
    images, target = torch.randn(4, 3, 16, 16, generator=generator), torch.tensor([0, 1, 2, 0])
    freezing.train(ddp)
    Step(ddp, optimizer)(images, target)
    changed = sorted(k for k, v in model.state_dict().items() if not v.equal(start[k]))
    states = len(optimizer.state)
    assert freezing.enter(1)
    ddp = rewrapped(ddp, ParallelSettings(), example, None)
    freezing.train(ddp)
    Step(ddp, optimizer)(images, target)
    weights = torch.cat([p.detach().flatten() for p in unwrap(ddp).parameters()])
    return changed, states, len(optimizer.state), weights


def test_a_frozen_backbone_is_untouched_then_trains_on_every_rank_alike():
    results = run_ranks(head_only_then_all, 2, timeout=120)
    for changed, states, states_after, _ in results:
        # BatchNorm statistics too: the backbone's norms stay in eval mode
        assert changed == ["fc.bias", "fc.weight"] and states == 2
        assert states_after == 62  # every parameter of resnet18
    (*_, a), (*_, b) = results
    assert torch.equal(a, b)  # the backbone's gradients were all-reduced after unfreezing
