"""--pretrained FILE is a collective: every rank loads the file, or every rank stops."""

import torch
import torchvision
from harness import run_ranks
from safetensors.torch import load_file, save_file

from ddptrain.errors import UserError
from ddptrain.model.build import build_model, load_pretrained


def load_then_refuse(env, fitting, other_arch):
    torch.manual_seed(env.rank)  # different initial weights on each rank
    model = build_model("resnet18", 3, 16, pretrained=False)
    load_pretrained(model, "resnet18", env, source=fitting)
    expected = load_file(fitting)
    loaded = all(torch.equal(v, expected[k]) for k, v in model.state_dict().items())
    try:
        load_pretrained(model, "resnet18", env, source=other_arch)
    except UserError as err:
        return loaded, str(err)
    return loaded, None


def test_every_rank_loads_the_file_and_every_rank_refuses_a_wrong_one(tmp_path):
    fitting, other = tmp_path / "r18.safetensors", tmp_path / "m.safetensors"
    save_file(torchvision.models.resnet18(num_classes=3).state_dict(), fitting)
    small = torchvision.models.mobilenet_v3_small(num_classes=3).state_dict()
    save_file(small, other, metadata={"arch": "mobilenet_v3_small"})
    (loaded0, refused0), (loaded1, refused1) = run_ranks(load_then_refuse, 2, fitting, other)
    assert loaded0 and loaded1
    # Rank 0 reads first and says why; the others stop with it instead of waiting.
    assert "holds mobilenet_v3_small weights, not --arch resnet18" in refused0
    assert refused1 == "another rank failed while setting up; its output says why"


def evaluate_a_new_head(env, ten_classes):
    # Under fsdp only rank 0 builds weights: the others, on the meta device, see no head.
    model = build_model("resnet18", 3, 16, pretrained=False, meta=env.rank > 0)
    try:
        load_pretrained(model, "resnet18", env, source=ten_classes, classes=["a", "b", "c"])
    except UserError as err:
        return str(err)
    return None


def test_evaluating_a_new_head_stops_every_rank(tmp_path):
    ten_classes = tmp_path / "ten.safetensors"
    save_file(torchvision.models.resnet18(num_classes=10).state_dict(), ten_classes)
    refused0, refused1 = run_ranks(evaluate_a_new_head, 2, ten_classes)
    assert "so the head (fc.bias, fc.weight) would be new, random weights" in refused0
    assert refused1 == "another rank failed while setting up; its output says why"
