import json

import pytest
import torch
from safetensors import safe_open

from ddptrain.errors import UserError
from ddptrain.tools.export import describe, export

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
