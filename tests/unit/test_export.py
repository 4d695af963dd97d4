import json

import pytest
import torch
import torchvision
from safetensors import safe_open

from ddptrain.errors import UserError
from ddptrain.tools.export import describe, export
from ddptrain.tools.inference import load_trained
from ddptrain.tools.onnx_export import export_onnx

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


def resnet18_checkpoint(path, **change):
    """A checkpoint of a 3-class resnet18 for 16 px crops, as training writes one."""
    model = torchvision.models.resnet18(num_classes=3)
    saved = {"model": model.state_dict(), "arch": "resnet18", "num_classes": 3}
    torch.save({**saved, "class_to_idx": CLASSES, "config": {"image_size": 16}, **change}, path)


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("arch", "resnet_nope", "arch is 'resnet_nope': no model this torchvision or timm"),
        ("arch", 5, "arch is 5: no model this torchvision or timm"),
        ("arch", "timm:convnext_atto.no_such_tag", "arch is 'timm:convnext_atto.no_such_tag'"),
        ("num_classes", "3", "num_classes is '3': not a whole number"),
        ("image_size", "big", "image_size is 'big': not a whole number of pixels"),
        ("image_size", 16.5, "image_size is 16.5: not a whole number of pixels"),
        ("model_image_size", [16], "model_image_size is [16]: not a whole number of pixels"),
        ("val_resize", 8, "val_resize is 8: not a whole number of pixels, at least 16"),
        ("image_size", 24, "val_resize is 18: smaller than the crop, 24"),
        ("mean", ["a", "b", "c"], "mean is ['a', 'b', 'c']: not 3 numbers"),
        ("std", [0.2, 0.2, 0], "std is [0.2, 0.2, 0]: not 3 numbers"),
        ("interpolation", "cubic", "interpolation is 'cubic': not one of bilinear"),
        ("classes", ["ant", "cat"], "num_classes is 3, and classes names 2 classes"),
        ("classes", ["ant", "cat", None], "classes is ['ant', 'cat', None]: not a list of names"),
    ],
)
def test_a_description_with_an_unusable_field_is_one_line_naming_it(tmp_path, field, value, says):
    resnet18_checkpoint(tmp_path / "c.pt")
    export(tmp_path / "c.pt", tmp_path / "w.safetensors")
    description = json.loads((tmp_path / "w.json").read_text())
    (tmp_path / "w.json").write_text(json.dumps({**description, field: value}))
    with pytest.raises(UserError) as caught:
        load_trained(tmp_path / "w.safetensors")
    assert str(caught.value).startswith(f"MODEL {tmp_path}/w.safetensors: {tmp_path}/w.json says")
    assert says in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"arch": "resnet_nope"}, "arch is 'resnet_nope': no model this torchvision or timm"),
        ({"num_classes": 5}, "num_classes is 5, and class_to_idx names 3 classes"),
        ({"class_to_idx": {"ant": 0, "cat": "x"}}, "class_to_idx is {'ant': 0, 'cat': 'x'}: not a"),
        ({"class_to_idx": {"ant": 0, "cat": 2}}, "class_to_idx is {'ant': 0, 'cat': 2}: not"),
        ({"config": {"image_size": "x"}}, "config.image_size is 'x': not a whole number"),
        ({"config": {"image_size": 16, "val_crop": 8}}, "config.val_crop is 8: not a whole"),
        ({"config": {"image_size": 16, "mean": ["a", "b", "c"]}}, "config.mean is ['a', 'b'"),
        ({"config": {"image_size": 16, "interpolation": 3}}, "config.interpolation is 3: not one"),
    ],
)
def test_a_checkpoint_with_an_unusable_field_is_one_line_naming_it(tmp_path, change, says):
    resnet18_checkpoint(tmp_path / "c.pt", **change)
    for run in (
        lambda: export(tmp_path / "c.pt", tmp_path / "w.safetensors"),
        lambda: load_trained(tmp_path / "c.pt"),
    ):
        with pytest.raises(UserError) as caught:
            run()
        assert says in str(caught.value) and "\n" not in str(caught.value)
        assert f"{tmp_path}/c.pt says" in str(caught.value)
    assert not (tmp_path / "w.safetensors").exists()


def test_export_replaces_an_earlier_exports_json_but_no_other(tmp_path):
    resnet18_checkpoint(tmp_path / "c.pt")
    run_config = '{"arch": "resnet18", "image_size": 16, "lr": 0.1}\n'
    (tmp_path / "config.json").write_text(run_config)
    for out in ("config.safetensors", "config.onnx"):
        write = export_onnx if out.endswith(".onnx") else export
        with pytest.raises(UserError, match=rf"^export: --out {tmp_path}/{out}: .*config.json"):
            write(tmp_path / "c.pt", tmp_path / out)
        assert not (tmp_path / out).exists()
    assert (tmp_path / "config.json").read_text() == run_config
    export(tmp_path / "c.pt", tmp_path / "w.safetensors")
    assert export(tmp_path / "c.pt", tmp_path / "w.safetensors")["arch"] == "resnet18"
