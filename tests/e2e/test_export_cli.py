"""`ddptrain export`, through the real CLI on the tiny dataset."""

import json

import pytest
import torch
import torchvision
from cli import ddptrain, ok, tiny_args
from safetensors.torch import load_file


@pytest.fixture(scope="module")
def trained(tiny_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    ok(ddptrain("train", *tiny_args(tiny_data, out)))
    return out


@pytest.fixture(scope="module")
def exported(trained, tmp_path_factory):
    weights = tmp_path_factory.mktemp("export") / "r18.safetensors"
    result = ok(ddptrain("export", trained / "checkpoint.pt", "--out", weights))
    assert f"wrote {weights} and {weights.with_suffix('.json')}" in result.stdout
    return weights


def test_export_loads_in_plain_torchvision_with_the_checkpoints_logits(trained, exported):
    sidecar = json.loads(exported.with_suffix(".json").read_text())
    model = torchvision.models.get_model(sidecar["arch"], num_classes=sidecar["num_classes"])
    model.load_state_dict(load_file(exported), strict=True)
    checkpoint = torch.load(trained / "checkpoint.pt", weights_only=True)
    reference = torchvision.models.get_model(checkpoint["arch"], num_classes=3)
    reference.load_state_dict(checkpoint["model"])
    images = torch.randn(4, 3, 16, 16)
    with torch.no_grad():
        assert torch.equal(model.eval()(images), reference.eval()(images))


def test_the_sidecar_says_how_to_feed_the_model(exported):
    assert json.loads(exported.with_suffix(".json").read_text()) == {
        "arch": "resnet18",
        "num_classes": 3,
        "classes": ["arrow", "bar", "circle"],
        "image_size": 16,
        "val_resize": 18,
        "interpolation": "bilinear",
        "mean": [0.485, 0.456, 0.406],
        "std": [0.229, 0.224, 0.225],
    }


def test_a_failed_export_is_one_line_and_leaves_the_earlier_files(trained, exported, tmp_path):
    before = exported.read_bytes()
    damaged = tmp_path / "damaged.pt"
    damaged.write_bytes((trained / "checkpoint.pt").read_bytes()[:1000])
    result = ddptrain("export", damaged, "--out", exported)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.startswith(f"ddptrain: error: {damaged}")
    assert exported.read_bytes() == before
    result = ddptrain("export", trained / "checkpoint.pt", "--out", tmp_path / "w.pt")
    assert result.returncode == 2 and "must end in .safetensors" in result.stderr
