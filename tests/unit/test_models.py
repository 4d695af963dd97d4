import pytest
import torch

from ddptrain.errors import UserError
from ddptrain.model.build import build_model
from ddptrain.train.step import Step


def test_head_follows_the_class_count():
    model = build_model("resnet18", 7, 32, pretrained=False)
    assert model.fc.out_features == 7


def test_the_size_check_leaves_batchnorm_statistics_as_built():
    model = build_model("resnet18", 3, 32, pretrained=False)
    assert torch.equal(model.bn1.running_mean, torch.zeros(64))
    assert int(model.bn1.num_batches_tracked) == 0


def test_a_rank_that_receives_rank_0s_weights_builds_the_structure_alone():
    meta = build_model("vit_b_16", 3, 32, pretrained=False, meta=True)
    assert all(t.is_meta for t in [*meta.parameters(), *meta.buffers()])
    assert meta.encoder.pos_embedding.shape[1] == 4 + 1  # sized for the crops all the same
    # RegNet reads its widths out of tensors, which the meta device does not hold: real weights.
    regnet = build_model("regnet_x_400mf", 3, 32, pretrained=False, meta=True)
    assert not any(p.is_meta for p in regnet.parameters())


@pytest.mark.parametrize(("arch", "size"), [("vit_b_32", 40), ("inception_v3", 224)])
def test_an_arch_that_cannot_take_the_crop_size_is_a_user_error(arch, size):
    with pytest.raises(UserError, match=f"--arch {arch} does not run on {size} px"):
        build_model(arch, 3, size, pretrained=False)


def test_a_vit_is_built_for_the_crop_size():
    # 32 px crops: one 32 px patch (vit_b_32) or 4 of 16 px (vit_b_16), not 224's 49 or 196.
    for arch, patches in (("vit_b_32", 1), ("vit_b_16", 4)):
        model = build_model(arch, 3, 32, pretrained=False)
        assert model.encoder.pos_embedding.shape[1] == patches + 1  # and the class token
        assert model(torch.zeros(1, 3, 32, 32)).shape == (1, 3)
    # for weights of ddptrain's own (--pretrained FILE) too: only torchvision's are for 224 px
    model = build_model("vit_b_32", 3, 32, pretrained="runs/vit/model_best.pt", meta=True)
    assert model.encoder.pos_embedding.shape[1] == 2


def test_auxiliary_heads_train_with_their_loss():
    model = build_model("googlenet", 3, 64, pretrained=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    images, target = torch.randn(2, 3, 64, 64), torch.tensor([0, 2])
    step = Step(model, optimizer)
    loss, output = step.forward(images, target)
    step.backward(loss)
    assert output.shape == (2, 3) and loss.ndim == 0
    assert model.aux1.fc2.weight.grad is not None  # the aux heads took part
    before = model.aux1.fc2.weight.detach().clone()
    step.optimizer_step()
    assert not torch.equal(model.aux1.fc2.weight, before)
