import json

import pytest
import torch
from safetensors import safe_open

from ddptrain.errors import UserError
from ddptrain.tools.export import describe, export
from ddptrain.tools.inference import load_trained

CLASSES = {"cat": 1, "ant": 0, "dog": 2}


def test_sidecar_follows_the_checkpoints_config():
    checkpoint = {"arch": "resnet50", "num_classes": 3, "class_to_idx": CLASSES}
    plain = describe({**checkpoint, "config": {"image_size": 224}}, "c.pt")
    assert plain["classes"] == ["ant", "cat", "dog"]  # index order, not name order
    assert (plain["val_resize"], plain["interpolation"]) == (256, "bilinear")
    config = {"image_size": 176, "val_resize": 232, "interpolation": "bicubic"}
    recipe = describe({**checkpoint, "config": config}, "c.pt")
    assert (recipe["image_size"], recipe["val_resize"], recipe["interpolation"]) == (
        176,
        232,
        "bicubic",
    )
    # torchvision's recipe trains on 176 px crops and evaluates on 224 px ones: the sidecar
    # describes the evaluation, as its users feed the model.
    config = {"image_size": 176, "val_crop": 224}
    recipe = describe({**checkpoint, "config": config}, "c.pt")
    assert (recipe["image_size"], recipe["val_resize"]) == (224, 256)


def test_a_checkpoint_without_what_the_sidecar_needs_is_refused():
    with pytest.raises(UserError, match=r"c.pt lacks class_to_idx, config.image_size"):
        describe({"arch": "resnet18", "model": {}}, "c.pt")


def test_weights_carry_their_arch_and_views_are_made_whole(tmp_path):
    weight = torch.arange(12.0).reshape(3, 4).t()  # a non-contiguous view
    saved = {"model": {"fc.weight": weight}, "arch": "resnet18", "class_to_idx": CLASSES}
    torch.save({**saved, "config": {"image_size": 32}}, tmp_path / "c.pt")
    description = export(tmp_path / "c.pt", tmp_path / "w.safetensors")
    with safe_open(tmp_path / "w.safetensors", framework="pt") as f:
        assert f.metadata()["arch"] == "resnet18" and f.metadata()["num_classes"] == "3"
        assert torch.equal(f.get_tensor("fc.weight"), weight)
    assert json.loads((tmp_path / "w.json").read_text()) == description


def test_a_model_built_for_its_training_size_loads_whatever_the_val_crop(tmp_path):
    # A ViT's position embedding has one entry per patch of the training size: trained on
    # 32 px and evaluated on 48 px crops, it must be rebuilt for 32 px.
    import timm

    model = timm.create_model("test_vit", img_size=32, num_classes=3)
    config = {"image_size": 32, "val_crop": 48}
    saved = {"model": model.state_dict(), "arch": "timm:test_vit", "class_to_idx": CLASSES}
    torch.save({**saved, "config": config}, tmp_path / "c.pt")
    description = export(tmp_path / "c.pt", tmp_path / "w.safetensors")
    assert (description["image_size"], description["model_image_size"]) == (48, 32)
    assert description["create_model_kwargs"]["img_size"] == 32
    images = torch.randn(2, 3, 48, 48)
    for path in (tmp_path / "c.pt", tmp_path / "w.safetensors"):
        trained = load_trained(path)
        assert trained.val_transform()(torch.zeros(3, 60, 60, dtype=torch.uint8)).shape[-1] == 48
        assert torch.equal(trained.model(images), model.eval()(images))
