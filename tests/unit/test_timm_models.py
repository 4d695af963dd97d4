"""timm's models through the provider seam: names, building at a crop size, fsdp's units, timm's
own layer grouping, the preprocessing of published weights, export."""

import hashlib
import json

import pytest
import timm
import torch
from safetensors.torch import load_file, save, save_file
from timm.optim import param_groups_layer_decay

from ddptrain.config import Config
from ddptrain.distributed.env import DistEnv
from ddptrain.errors import UserError
from ddptrain.model.build import build_model, load_pretrained
from ddptrain.model.providers import TIMM, TORCHVISION, provider
from ddptrain.parallel.fsdp import shard_units
from ddptrain.resolve import published_preprocessing
from ddptrain.tools.export import export
from ddptrain.train.finetune import fine_tuning


def test_the_name_picks_the_provider():
    assert provider("timm:convnext_atto") is TIMM
    assert provider("timm:convnext_atto.d2_in1k") is TIMM
    assert provider("resnet18") is TORCHVISION
    assert "timm:convnext_atto" in TIMM.names


@pytest.mark.parametrize(
    ("arch", "says"),
    [
        ("timm:no_such_net", "timm has no model 'no_such_net'"),
        ("timm:convnext_atto.no_such_tag", "no weights tagged 'no_such_tag' for convnext_atto"),
    ],
)
def test_an_unknown_timm_model_or_tag_is_one_line(arch, says):
    with pytest.raises(UserError, match=says) as caught:
        Config(arch=arch)
    assert "\n" not in str(caught.value)


def test_a_tagged_name_is_taken():
    assert Config(arch="timm:convnext_atto.d2_in1k").model.arch == "timm:convnext_atto.d2_in1k"


def test_a_vit_is_built_for_the_crop_size_and_the_class_count():
    model = build_model("timm:test_vit", 7, 32, False)
    assert model.pos_embed.shape[1] == 1 + (32 // 16) ** 2  # the class token and 2x2 patches
    assert TIMM.classifier(model)[0].out_features == 7
    assert model(torch.zeros(1, 3, 32, 32)).shape == (1, 7)
    # a convolutional net takes any size: no img_size to pass
    assert TIMM.model_kwargs("timm:resnet10t", 7, 32) == {"num_classes": 7}
    on_meta = build_model("timm:test_vit", 7, 32, False, meta=True)
    assert on_meta.pos_embed.is_meta and on_meta.pos_embed.shape == model.pos_embed.shape


@pytest.mark.parametrize(
    ("arch", "block", "count"),
    [
        ("timm:resnet10t", timm.models.resnet.BasicBlock, 4),
        ("timm:convnext_atto", timm.models.convnext.ConvNeXtBlock, 12),
        ("timm:test_vit", timm.models.vision_transformer.Block, 6),
    ],
)
def test_fsdp_shards_timms_blocks(arch, block, count):
    units = shard_units(build_model(arch, 3, 32, False, meta=True))
    assert len(units) == count and all(type(u) is block for u in units)


@pytest.mark.parametrize("arch", ["timm:test_vit", "timm:convnext_atto", "timm:resnet10t"])
def test_layer_ids_are_timms_own_layer_decay_grouping(arch):
    model = build_model(arch, 3, 32, False)
    ids = TIMM.layer_ids(model)
    assert set(ids) == {name for name, _ in model.named_parameters()}
    highest = max(ids.values())
    assert highest > 1 and min(ids.values()) == 0
    # timm's groups carry lr_scale = decay ** (highest - layer): each parameter's scale there
    # is the one its layer id here gives
    decay = 0.5
    scale_of = {
        id(p): group["lr_scale"]
        for group in param_groups_layer_decay(model, layer_decay=decay)
        for p in group["params"]
    }
    for name, p in model.named_parameters():
        assert scale_of[id(p)] == decay ** (highest - ids[name]), name
    (classifier,) = TIMM.classifier(model)
    head = set(map(id, classifier.parameters()))
    assert {ids[n] for n, p in model.named_parameters() if id(p) in head} == {highest}


def test_grad_checkpointing_is_timms_switch():
    model = build_model("timm:test_vit", 3, 32, False)
    TIMM.set_grad_checkpointing(model, "timm:test_vit")
    assert model.grad_checkpointing


def step_of_resnet10t(checkpointing: bool):
    torch.manual_seed(0)
    model = build_model("timm:resnet10t", 3, 32, False)
    if checkpointing:
        TIMM.set_grad_checkpointing(model, "timm:resnet10t")
    loss = torch.nn.functional.cross_entropy(model(torch.randn(4, 3, 32, 32)), torch.arange(4) % 3)
    loss.backward()
    return model, loss.detach()


def test_grad_checkpointing_of_blocks_with_batch_norm_updates_its_statistics_once():
    plain, loss = step_of_resnet10t(False)
    model, checkpointed_loss = step_of_resnet10t(True)
    assert type(model.layer1[0]).__name__ == "CheckpointedBasicBlock"
    assert checkpointed_loss == loss
    for (name, p), q in zip(plain.named_parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    buffers = dict(model.named_buffers())
    for name, buffer in plain.named_buffers():
        assert torch.equal(buffers[name], buffer), name
    assert list(model.state_dict()) == list(plain.state_dict())


def test_drop_path_sets_timms_rate_and_is_refused_where_there_is_none():
    model = TIMM.build("timm:test_vit", 3, 32, False, False, drop_path=0.2)
    assert model.blocks[-1].drop_path1.drop_prob == pytest.approx(0.2)
    with pytest.raises(UserError, match="--drop-path: --arch timm:vgg11 has no stochastic depth"):
        TIMM.build("timm:vgg11", 3, 32, False, True, drop_path=0.1)


def test_pretrained_takes_the_weights_preprocessing_unless_given():
    # test_vit's weights: 160 px, bicubic, mean and std 0.5, crop_pct 0.95
    config = published_preprocessing(Config(arch="timm:test_vit", pretrained=True), frozenset())
    data = config.data
    assert (data.image_size, data.interpolation) == (160, "bicubic")
    assert data.mean == data.std == (0.5, 0.5, 0.5)
    assert data.val_resize == int(160 / 0.95)
    given = Config(arch="timm:test_vit", pretrained=True, image_size=32, interpolation="nearest")
    data = published_preprocessing(given, frozenset({"image_size", "interpolation"})).data
    assert (data.image_size, data.interpolation, data.mean) == (32, "nearest", (0.5, 0.5, 0.5))
    assert data.val_resize == int(32 / 0.95)
    # not for a file's weights, nor torchvision's
    for untouched in (Config(arch="timm:test_vit"), Config(arch="resnet18", pretrained=True)):
        assert published_preprocessing(untouched, frozenset()) == untouched


def test_pretrained_file_takes_the_published_preprocessing_or_the_files_own(tmp_path):
    # timm's own weights file (what hub.py's error suggests): the published weights' input
    save_file({"head.bias": torch.zeros(3)}, tmp_path / "model.safetensors")
    config = Config(arch="timm:test_vit", pretrained=str(tmp_path / "model.safetensors"))
    data = published_preprocessing(config, frozenset()).data
    assert (data.image_size, data.interpolation, data.mean) == (160, "bicubic", (0.5, 0.5, 0.5))
    # a ddptrain export or checkpoint carries its run's own normalisation and interpolation
    own = {"mean": [0.2, 0.3, 0.4], "std": [0.1, 0.2, 0.3], "interpolation": "nearest"}
    save_file({"head.bias": torch.zeros(3)}, tmp_path / "w.safetensors")
    (tmp_path / "w.json").write_text(json.dumps({"arch": "timm:test_vit", **own}))
    run_config = {"image_size": 24, "mean": (0.2, 0.3, 0.4), "std": (0.1, 0.2, 0.3)}
    run_config["interpolation"] = "nearest"
    torch.save({"model": {}, "config": run_config}, tmp_path / "c.pt")
    for path in ("w.safetensors", "c.pt"):
        config = Config(arch="timm:test_vit", pretrained=str(tmp_path / path), image_size=32)
        data = published_preprocessing(config, frozenset({"image_size"})).data
        assert (data.image_size, data.interpolation) == (32, "nearest"), path
        assert (data.mean, data.std) == ((0.2, 0.3, 0.4), (0.1, 0.2, 0.3)), path
    # flags still win
    given = Config(arch="timm:test_vit", pretrained=str(tmp_path / "c.pt"), mean=(0.5, 0.5, 0.5))
    assert published_preprocessing(given, frozenset({"mean"})).data.mean == (0.5, 0.5, 0.5)


def test_an_export_of_a_timm_run_loads_strictly_into_timm(tmp_path):
    model = build_model("timm:test_vit", 4, 32, False)
    config = Config(arch="timm:test_vit", image_size=32, mean=(0.5, 0.5, 0.5), std=(0.5,) * 3)
    checkpoint = {
        "arch": "timm:test_vit",
        "num_classes": 4,
        "class_to_idx": {c: i for i, c in enumerate("abcd")},
        "config": config.to_dict(),
        "model": model.state_dict(),
    }
    torch.save(checkpoint, tmp_path / "checkpoint.pt")
    export(tmp_path / "checkpoint.pt", tmp_path / "w.safetensors")
    said = json.loads((tmp_path / "w.json").read_text())
    assert said["library"] == "timm" and said["timm_name"] == "test_vit"
    assert said["create_model_kwargs"] == {"num_classes": 4, "img_size": 32}
    assert said["mean"] == [0.5, 0.5, 0.5]
    rebuilt = timm.create_model(said["timm_name"], **said["create_model_kwargs"])
    rebuilt.load_state_dict(load_file(tmp_path / "w.safetensors"), strict=True)
    images = torch.rand(2, 3, 32, 32)
    torch.testing.assert_close(rebuilt.eval()(images), model.eval()(images), rtol=0, atol=0)


def test_pretrained_file_takes_timms_own_model_safetensors(tmp_path):
    # what the Hub's cache holds for resnet10t: timm's state dict, 1000 classes, no metadata
    torch.manual_seed(5)
    published = timm.create_model("resnet10t").state_dict()
    save_file(published, tmp_path / "model.safetensors")
    model = build_model("timm:resnet10t", 3, 32, False)
    env = DistEnv(0, 1, 0, 1, torch.device("cpu"))
    fresh = load_pretrained(
        model, "timm:resnet10t", env, source=str(tmp_path / "model.safetensors")
    )
    assert fresh == ["fc.bias", "fc.weight"]  # the head of 3 classes starts new
    for name, tensor in model.state_dict().items():
        if name not in fresh:
            assert torch.equal(tensor, published[name]), name


@pytest.mark.parametrize("arch", ["timm:levit_128s", "timm:deit_tiny_distilled_patch16_224"])
def test_both_heads_of_a_distilled_model_are_its_head(arch):
    """get_classifier() of a distilled model is a tuple (head, head_dist): both are the head."""
    model = build_model(arch, 3, 32, False, meta=True)
    no_flags = Config(arch=arch).optim
    assert fine_tuning(no_flags, TIMM, model, epoch=0) == (None, None)  # no head needed
    config = Config(arch=arch, freeze_backbone=True, head_lr_scale=10)
    layers, freezing = fine_tuning(config.optim, TIMM, model, epoch=0)
    names = {name for name, _ in model.named_parameters()}
    both = {name for name in names if name.startswith(("head.", "head_dist."))}
    assert len(both) >= 4 and freezing.head == both
    assert {name for name, (group, _) in layers.items() if group == "head"} == both


def test_grad_checkpointing_on_a_model_without_it_is_refused():
    model = build_model("timm:inception_v3", 3, 32, False, meta=True)
    with pytest.raises(UserError, match="--grad-checkpointing: timm:inception_v3 does not support"):
        TIMM.set_grad_checkpointing(model, "timm:inception_v3")


@pytest.mark.parametrize("damage", ["truncated", "altered"])
def test_a_damaged_file_in_the_hugging_face_cache_is_one_line_saying_to_fetch_it_again(
    tmp_path, monkeypatch, damage
):
    """The cache's layout, as `hf download timm/test_vit.r160_in1k` leaves it: the snapshot's
    file a link to a blob named by its sha256. Truncated: the file is no safetensors file any
    more; altered: it still is, but its bytes no longer match its name."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))  # read when called
    repo = tmp_path / "hub" / "models--timm--test_vit.r160_in1k"
    published = save(timm.create_model("test_vit").state_dict())
    blob = repo / "blobs" / hashlib.sha256(published).hexdigest()
    snapshot = repo / "snapshots" / ("0" * 40)
    for folder in (blob.parent, snapshot, repo / "refs"):
        folder.mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)
    damaged = (
        published[: len(published) // 2] if damage == "truncated" else published[:-4] + b"\0" * 4
    )
    blob.write_bytes(damaged)
    (snapshot / "model.safetensors").symlink_to(blob)
    model = build_model("timm:test_vit", 3, 32, False)
    env = DistEnv(0, 1, 0, 1, torch.device("cpu"))
    with pytest.raises(UserError) as caught:
        load_pretrained(model, "timm:test_vit", env, image_size=32)
    assert str(caught.value).startswith(f"--pretrained: {blob}, ")
    assert "hf download timm/test_vit.r160_in1k model.safetensors --force-download" in str(
        caught.value
    )
    assert "\n" not in str(caught.value)
