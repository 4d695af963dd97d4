"""The fine-tuning controls' parts: LR groups by layer (against timm's own), the torchvision
provider's layer map, head, stochastic depth and activation checkpointing."""

import copy
import re

import pytest
import timm
import torch
from timm.models import group_parameters
from timm.optim import param_groups_layer_decay

from ddptrain.config import Config
from ddptrain.errors import UserError
from ddptrain.model.providers import TORCHVISION
from ddptrain.state.resume import check_continuable
from ddptrain.train.finetune import head_names, lr_layers
from ddptrain.train.optim import build_optimizer, group_lrs, schedule_lr


def scales_and_decays(groups, names) -> dict[str, tuple[float, float]]:
    """Each parameter's (LR scale, weight decay), by name."""
    return {names[id(p)]: (g["lr_scale"], g["weight_decay"]) for g in groups for p in g["params"]}


def test_layer_decay_groups_are_timms_own_given_its_layer_map():
    model = timm.create_model("resnet10t", num_classes=3)
    layer_map = group_parameters(model, model.group_matcher(coarse=False), reverse=True)
    top = max(layer_map.values())
    layer_ids = {name: layer_map.get(name, top) for name, _ in model.named_parameters()}
    head = head_names(model, (model.get_classifier(),))
    config = Config(
        opt="adamw", lr=1e-3, weight_decay=0.05, norm_weight_decay=0.0, layer_decay=0.7
    ).optim
    optimizer, _ = build_optimizer(model, config, layers=lr_layers(layer_ids, head, 0.7))
    names = {id(p): name for name, p in model.named_parameters()}
    theirs = param_groups_layer_decay(model, weight_decay=0.05, layer_decay=0.7)
    ours = scales_and_decays(optimizer.param_groups, names)
    assert ours == scales_and_decays(theirs, names) and len(ours) == len(names)
    assert len({scale for scale, _ in ours.values()}) == top + 1 > 3
    for group in optimizer.param_groups:
        assert group["lr"] == 1e-3 * group["lr_scale"] == group["initial_lr"]


def test_the_head_lr_scale_multiplies_the_head_alone_and_the_records_see_each_group():
    model = TORCHVISION.build("resnet18", 3, 16, False, False)
    head = head_names(model, TORCHVISION.classifier(model))
    layers = lr_layers(TORCHVISION.layer_ids(model), head, None, head_lr_scale=10)
    optimizer, scheduler = build_optimizer(model, Config(lr=0.1).optim, layers=layers)
    head_group, body = sorted(optimizer.param_groups, key=lambda g: g["layer"] != "head")
    assert {id(p) for p in head_group["params"]} == {id(model.fc.weight), id(model.fc.bias)}
    assert head_group["lr"] == pytest.approx(1.0) and body["lr"] == 0.1
    assert schedule_lr(optimizer) == 0.1
    assert group_lrs(optimizer, 0.1) == {"body": 0.1, "head": pytest.approx(1.0)}
    # without the flags: one group, as before, and no groups to record
    optimizer, _ = build_optimizer(model, Config(lr=0.1).optim, layers=lr_layers({}, set(), None))
    assert len(optimizer.param_groups) == 1 and group_lrs(optimizer, 0.1) == {}


@pytest.mark.parametrize(
    ("arch", "first", "in_head_layer"),
    [
        ("resnet18", {"conv1.weight", "bn1.weight", "bn1.bias"}, {"fc.weight", "fc.bias"}),
        (
            "vit_b_16",
            {"class_token", "conv_proj.weight", "conv_proj.bias", "encoder.pos_embedding"},
            {"encoder.ln.weight", "heads.head.weight"},
        ),
        ("convnext_tiny", None, {"classifier.0.weight", "classifier.2.weight"}),
    ],
)
def test_torchvision_layers_are_the_stem_each_block_then_the_head(arch, first, in_head_layer):
    model = TORCHVISION.build(arch, 3, 32, False, True)  # meta: structure only
    ids = TORCHVISION.layer_ids(model)
    blocks = [m for m in model.modules() if isinstance(m, TORCHVISION.blocks)]
    top = max(ids.values())
    assert top == len(blocks) + 1 and list(ids) == [n for n, _ in model.named_parameters()]
    assert sorted(set(ids.values())) == list(range(top + 1))
    assert list(ids.values()) == sorted(ids.values())  # depth order
    if first is not None:
        assert {n for n, i in ids.items() if i == 0} == first
    assert {n for n, i in ids.items() if i == top} >= in_head_layer


def test_drop_path_sets_stochastic_depth_or_is_refused():
    model = TORCHVISION.build("convnext_tiny", 3, 32, False, True, drop_path=0.3)
    rates = [m.p for m in model.modules() if type(m).__name__ == "StochasticDepth"]
    assert rates and max(rates) == pytest.approx(0.3)
    with pytest.raises(UserError, match="--drop-path: torchvision's resnet18 has no stochastic"):
        TORCHVISION.build("resnet18", 3, 32, False, True, drop_path=0.1)
    with pytest.raises(UserError, match="--drop-path must be in"):
        Config(drop_path=1.0)


def test_unfreeze_epoch_needs_freeze_backbone():
    with pytest.raises(UserError, match="--unfreeze-epoch 2 needs --freeze-backbone"):
        Config(unfreeze_epoch=2)
    assert Config(unfreeze_epoch=2, freeze_backbone=True).optim.unfreeze_epoch == 2


def loss_and_gradients(checkpointing: bool):
    torch.manual_seed(0)
    model = TORCHVISION.build("resnet18", 3, 16, False, False)
    if checkpointing:
        TORCHVISION.set_grad_checkpointing(model, "resnet18")
    images, target = torch.randn(4, 3, 16, 16), torch.tensor([0, 1, 2, 0])
    loss = torch.nn.functional.cross_entropy(model(images), target)
    loss.backward()
    return model, loss.detach(), [p.grad for p in model.parameters()]


def test_grad_checkpointing_gives_the_same_loss_gradients_statistics_and_names():
    plain, loss, grads = loss_and_gradients(False)
    model, checkpointed_loss, checkpointed_grads = loss_and_gradients(True)
    assert type(model.layer1[0]).__name__ == "CheckpointedBasicBlock"
    assert checkpointed_loss == loss
    for a, b in zip(grads, checkpointed_grads, strict=True):
        torch.testing.assert_close(a, b)
    # BatchNorm's running statistics are updated once a step, not again by the recompute
    buffers = dict(model.named_buffers())
    for name, buffer in plain.named_buffers():
        assert torch.equal(buffers[name], buffer), name
    assert buffers["layer1.0.bn1.num_batches_tracked"] == 1
    assert list(model.state_dict()) == list(plain.state_dict())
    twin = copy.deepcopy(model)  # the EMA's: checkpointed too, of its own weights
    assert type(twin.layer1[0]) is type(model.layer1[0])


@pytest.mark.parametrize("arch", ["vgg11", "alexnet", "squeezenet1_0", "googlenet"])
def test_grad_checkpointing_without_blocks_to_checkpoint_is_refused(arch):
    model = TORCHVISION.build(arch, 3, 32, False, True)  # meta: structure only
    with pytest.raises(UserError, match=f"--grad-checkpointing: torchvision's {arch} has no"):
        TORCHVISION.set_grad_checkpointing(model, arch)


def test_layer_decay_or_head_lr_scale_changed_on_resume_is_one_line(tmp_path):
    """They shape the optimizer's parameter groups, which the saved state loads into."""
    saved = {"config": Config(layer_decay=0.8).to_dict()}
    check_continuable(saved, Config(layer_decay=0.8, freeze_backbone=True), tmp_path)
    with pytest.raises(UserError, match=re.escape("no --layer-decay (trained with 0.8)")):
        check_continuable(saved, Config(), tmp_path)
    with pytest.raises(UserError, match=re.escape("--head-lr-scale 10 (trained with 1)")):
        check_continuable(saved, Config(layer_decay=0.8, head_lr_scale=10), tmp_path)
