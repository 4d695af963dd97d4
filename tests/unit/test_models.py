import pytest
import torch
from torch import nn

from ddptrain import models, trainer
from ddptrain.errors import UserError


def test_head_follows_the_class_count():
    model = models.build("resnet18", 7, 32, pretrained=False)
    assert model.fc.out_features == 7


def test_the_size_check_leaves_batchnorm_statistics_as_built():
    model = models.build("resnet18", 3, 32, pretrained=False)
    assert torch.equal(model.bn1.running_mean, torch.zeros(64))
    assert int(model.bn1.num_batches_tracked) == 0


@pytest.mark.parametrize(("arch", "size"), [("vit_b_32", 32), ("inception_v3", 224)])
def test_an_arch_that_cannot_take_the_crop_size_is_a_user_error(arch, size):
    with pytest.raises(UserError, match=f"--arch {arch} does not run on {size} px"):
        models.build(arch, 3, size, pretrained=False)


def test_auxiliary_heads_train_with_their_loss():
    model = models.build("googlenet", 3, 64, pretrained=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    images, target = torch.randn(2, 3, 64, 64), torch.tensor([0, 2])
    loss, output = trainer.train_step(model, nn.CrossEntropyLoss(), optimizer, images, target)
    assert output.shape == (2, 3) and loss.ndim == 0
    assert model.aux1.fc2.weight.grad is not None  # the aux heads took part
