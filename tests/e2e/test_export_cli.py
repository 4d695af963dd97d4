"""`ddptrain export` and `--pretrained FILE`, through the real CLI on the tiny dataset."""

import json

import pytest
import torch
import torchvision
from cli import ddptrain, ok, tiny_args, val_records
from safetensors.torch import load_file

from ddptrain.data.synth import SynthSpec, write


# run.py still passes only the arch to load_pretrained; these pass once it passes the file too
# (`load_pretrained(model, config.arch, env, source=config.pretrained)`).
@pytest.fixture(scope="module")
def trained(one_rank_run):
    return one_rank_run  # read only: exports go elsewhere


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
        "library": "torchvision",
        "arch": "resnet18",
        "num_classes": 3,
        "model_image_size": 16,
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


def test_eval_with_pretrained_export_matches_eval_of_the_checkpoint(
    tiny_data, trained, exported, tmp_path
):
    # One precision for both: --resume keeps the checkpoint's, --pretrained takes --amp auto's.
    common = (tiny_data, "--image-size", "16", "-b", "8", "-j", "0", "--amp", "none")
    ok(
        ddptrain(
            "eval", *common, "--resume", trained / "checkpoint.pt", "--out-dir", tmp_path / "a"
        )
    )
    ok(ddptrain("eval", *common, "--pretrained", exported, "--out-dir", tmp_path / "b"))
    (a,), (b,) = val_records(tmp_path / "a"), val_records(tmp_path / "b")
    # the same loss and accuracies; a pretrained model is at epoch 0, step 0
    assert {**a, "epoch": 0, "global_step": 0} == b


def test_pretrained_checkpoint_of_another_class_count_gets_a_new_head(tiny_data, tmp_path_factory):
    four = write(
        SynthSpec(classes=4, train_per_class=4, val_per_class=2, size=24, seed=1),
        tmp_path_factory.mktemp("data") / "four",
    )
    source = tmp_path_factory.mktemp("four-run")
    ok(ddptrain("train", *tiny_args(four, source)))
    out = tmp_path_factory.mktemp("finetune")
    pretrained = source / "checkpoint.pt"
    result = ok(ddptrain("train", *tiny_args(tiny_data, out), "--pretrained", pretrained))
    said = f"pretrained resnet18 from {pretrained}: new weights for fc.bias, fc.weight"
    assert result.stdout.count(said) == 1  # once, by the Reporter
