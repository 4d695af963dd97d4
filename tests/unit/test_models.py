import pytest
import torch

from ddptrain.errors import UserError
from ddptrain.model.build import build_model
from ddptrain.train.trainer import Step


def test_head_follows_the_class_count():
    model = build_model("resnet18", 7, 32, pretrained=False)
    assert model.fc.out_features == 7


def test_the_size_check_leaves_batchnorm_statistics_as_built():
    model = build_model("resnet18", 3, 32, pretrained=False)
    assert torch.equal(model.bn1.running_mean, torch.zeros(64))
    assert int(model.bn1.num_batches_tracked) == 0


@pytest.mark.parametrize(("arch", "size"), [("vit_b_32", 32), ("inception_v3", 224)])
def test_an_arch_that_cannot_take_the_crop_size_is_a_user_error(arch, size):
    with pytest.raises(UserError, match=f"--arch {arch} does not run on {size} px"):
        build_model(arch, 3, size, pretrained=False)


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
