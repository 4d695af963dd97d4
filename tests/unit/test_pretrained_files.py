"""--pretrained FILE: a `ddptrain export` or a ddptrain checkpoint as initial weights."""

import pytest
import torch
import torchvision
from safetensors.torch import save_file

from ddptrain.cli import parse
from ddptrain.distributed.env import DistEnv
from ddptrain.errors import UserError
from ddptrain.model.build import build_model, load_pretrained
from ddptrain.model.providers import provider
from ddptrain.tools.export import export

ONE = DistEnv(0, 1, 0, 1, torch.device("cpu"))


def checkpoint_file(path, arch="resnet18", num_classes=3, seed=1):
    """A ddptrain checkpoint as training writes it (the parts --pretrained and export read)."""
    torch.manual_seed(seed)
    model = torchvision.models.get_model(arch, num_classes=num_classes)
    classes = {f"c{i}": i for i in range(num_classes)}
    saved = {"model": model.state_dict(), "arch": arch, "num_classes": num_classes}
    torch.save({**saved, "class_to_idx": classes, "config": {"image_size": 16}}, path)
    return model.state_dict()


def fresh_model(num_classes=3):
    torch.manual_seed(0)
    return build_model("resnet18", num_classes, 16, pretrained=False)


def assert_equal_except(model, state, fresh: set):
    for name, tensor in model.state_dict().items():
        if name not in fresh:
            assert torch.equal(tensor, state[name]), name


def test_an_export_loads_every_weight(tmp_path):
    state = checkpoint_file(tmp_path / "ckpt.pt")
    export(tmp_path / "ckpt.pt", tmp_path / "w.safetensors")
    model = fresh_model()
    assert load_pretrained(model, "resnet18", ONE, source=str(tmp_path / "w.safetensors")) == []
    assert_equal_except(model, state, fresh=set())


def test_a_checkpoint_of_another_class_count_leaves_the_head_new(tmp_path):
    state = checkpoint_file(tmp_path / "ten.pt", num_classes=10)
    model = fresh_model(num_classes=3)
    head_before = model.fc.weight.clone()
    fresh = load_pretrained(model, "resnet18", ONE, source=str(tmp_path / "ten.pt"))
    assert fresh == ["fc.bias", "fc.weight"]
    assert_equal_except(model, state, fresh=set(fresh))
    assert torch.equal(model.fc.weight, head_before) and model.fc.out_features == 3


@pytest.mark.parametrize("kind", ["checkpoint", "export"])
def test_evaluated_weights_must_know_the_datas_classes(tmp_path, kind):
    checkpoint_file(tmp_path / "three.pt")  # classes c0, c1, c2
    checkpoint_file(tmp_path / "ten.pt", num_classes=10)
    source = {name: tmp_path / f"{name}.pt" for name in ("three", "ten")}
    if kind == "export":  # the class names in the W.json beside the weights
        for name, path in source.items():
            source[name] = path.with_suffix(".safetensors")
            export(path, source[name])

    def evaluate(name, classes):
        model = fresh_model(len(classes))
        return load_pretrained(model, "resnet18", ONE, str(source[name]), classes)

    assert evaluate("three", ["c0", "c1", "c2"]) == []
    with pytest.raises(UserError, match=r"class 1 is 'c1' there and 'bar' here"):
        evaluate("three", ["c0", "bar", "c2"])
    with pytest.raises(UserError, match=r"data's 3, so the head \(fc.bias, fc.weight\) would"):
        evaluate("ten", ["c0", "c1", "c2"])


def test_auxiliary_heads_are_heads_too(tmp_path):
    checkpoint_file(tmp_path / "g.pt", arch="googlenet", num_classes=5)
    model = build_model("googlenet", 3, 64, pretrained=False)
    fresh = load_pretrained(model, "googlenet", ONE, source=str(tmp_path / "g.pt"))
    assert fresh == [f"{m}.{p}" for m in ("aux1.fc2", "aux2.fc2", "fc") for p in ("bias", "weight")]


def test_a_file_for_another_arch_is_one_clear_error(tmp_path):
    checkpoint_file(tmp_path / "m.pt", arch="mobilenet_v3_small")
    export(tmp_path / "m.pt", tmp_path / "m.safetensors")
    for name in ("m.pt", "m.safetensors"):
        with pytest.raises(
            UserError, match=rf"{name} holds mobilenet_v3_small weights, not --arch"
        ):
            load_pretrained(fresh_model(), "resnet18", ONE, source=str(tmp_path / name))
    # A safetensors file that does not say its arch is caught by its keys.
    bare = tmp_path / "bare.safetensors"
    save_file(torchvision.models.mobilenet_v3_small(num_classes=3).state_dict(), bare)
    with pytest.raises(UserError, match=r"bare.safetensors does not fit --arch resnet18: \d+ weig"):
        load_pretrained(fresh_model(), "resnet18", ONE, source=str(bare))


# (64, 3, 5, 5) differs in a kernel; (32, 3, 7, 7) in its first dimension only, as a
# classifier of another class count would, but conv1 is no classifier.
@pytest.mark.parametrize("shape", [(64, 3, 5, 5), (32, 3, 7, 7)])
def test_a_weight_of_another_shape_outside_the_head_is_refused(tmp_path, shape):
    state = torchvision.models.resnet18(num_classes=3).state_dict()
    state["conv1.weight"] = torch.zeros(shape)
    save_file(state, tmp_path / "odd.safetensors")
    with pytest.raises(UserError, match=rf"conv1.weight is \({', '.join(map(str, shape))}\) there"):
        load_pretrained(fresh_model(), "resnet18", ONE, source=str(tmp_path / "odd.safetensors"))


@pytest.mark.parametrize(
    ("arch", "heads"),
    [
        ("resnet18", ["fc"]),
        ("squeezenet1_0", ["classifier.1"]),
        ("googlenet", ["aux1.fc2", "aux2.fc2", "fc"]),
        ("inception_v3", ["AuxLogits.fc", "fc"]),
        ("timm:deit_tiny_distilled_patch16_224", ["head", "head_dist"]),
    ],
)
def test_the_provider_names_every_classifier_auxiliary_ones_too(arch, heads):
    model = build_model(arch, 3, 32, False, meta=True)
    names = provider(arch).classifier_names(model)
    assert names == {f"{head}.{p}" for head in heads for p in ("weight", "bias")}


@pytest.mark.parametrize("name", ["missing.pt", "garbage.safetensors", "garbage.pt", "."])
def test_a_missing_or_unreadable_file_is_one_error_naming_it(tmp_path, name):
    (tmp_path / "garbage.safetensors").write_bytes(b"\x08" + b"\x00" * 7 + b"not json")
    (tmp_path / "garbage.pt").write_bytes(b"not a checkpoint")
    path = tmp_path / name
    with pytest.raises(UserError, match=rf"^--pretrained: {path}"):
        load_pretrained(fresh_model(), "resnet18", ONE, source=str(path))


def test_the_flag_takes_an_optional_file(tmp_path):
    assert parse(["train", "DATA", "--pretrained"])[1][0].model.pretrained is True
    assert (
        parse(["train", "--pretrained", "w.safetensors", "DATA"])[1][0].model.pretrained
        == "w.safetensors"
    )
    assert parse(["train", "--pretrained=w.pt"])[1][0].model.pretrained == "w.pt"
    assert parse(["train"])[1][0].model.pretrained is False
    assert parse(["eval", "--pretrained", "w.safetensors"])[1][0].checkpoint.evaluate
    # The classic example's `--pretrained DATA`: a directory is the data, not a weights file.
    config = parse(["train", "--pretrained", str(tmp_path)])[1][0]
    assert (config.model.pretrained, config.data.root) == (True, str(tmp_path))
    with pytest.raises(UserError, match="--pretrained FILE: the path is empty"):
        parse(["train", "--pretrained="])


def test_only_torchvision_weights_get_their_input_transform():
    assert build_model("googlenet", 3, 64, pretrained=True).transform_input
    assert not build_model("googlenet", 3, 64, pretrained="g.safetensors").transform_input
