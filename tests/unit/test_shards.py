"""A packed set as DATA (data/shards.py): the folder's samples and digest, the image check's
names, shard handles kept per process, and every kind of bad set named in one line."""

import json
import os
import shutil

import pytest
import torch

from ddptrain.config import Config
from ddptrain.data import shards
from ddptrain.data.loaders import build_data
from ddptrain.data.sources import FolderSource, open_source, source_at
from ddptrain.data.transforms import val_transform
from ddptrain.distributed.env import DistEnv
from ddptrain.errors import UserError


def test_a_packed_set_is_its_folder(tiny_data, tiny_packed):
    packed, folder = source_at(tiny_packed), source_at(tiny_data)
    assert isinstance(packed, shards.ShardSource) and isinstance(folder, FolderSource)
    assert packed.has("train") and packed.has("val")
    assert source_at(tiny_packed / "index.json").root == str(tiny_packed)  # the file too
    for split in ("train", "val"):
        mine, theirs = packed.split(split), folder.split(split)
        assert mine.class_to_idx == theirs.class_to_idx
        assert {k: mine.facts[k] for k in ("images", "digest")} == theirs.facts
        assert mine.facts["shards"] == {
            f"{split}/{p.name}": p.stat().st_size for p in sorted((tiny_packed / split).iterdir())
        }
        for (image, label), (expected, target) in zip(mine.dataset, theirs.dataset, strict=True):
            assert torch.equal(image, expected) and label == target
    assert packed.names() == folder.names()  # what the image check and --bad-images skip name
    assert packed.shown("train/bar/00001.png") == f"bar/00001.png in {tiny_packed}/train/000001.tar"
    assert packed.problem("val/circle/00004.png") is None


def test_loaders_on_a_packed_set(tiny_packed):
    config = Config(data=str(tiny_packed), batch_size=8, workers=0, image_size=16)
    one = DistEnv(
        rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu")
    )
    data = build_data(config, one, open_source(config), seed=0)
    assert (data.num_classes, data.num_val, data.steps_per_epoch) == (3, 15, 3)
    data.train_sampler.set_epoch(0)
    images, _ = next(iter(data.train_loader))
    assert images.shape == (8, 3, 16, 16) and images.dtype == torch.uint8


def test_leaving_out_samples_keeps_the_order_of_the_rest(tiny_packed):
    source = source_at(tiny_packed)
    left_out = frozenset({"train/bar/00003.png", "val/arrow/00000.png"})
    train = source.split("train", leave_out=left_out)
    names = source.index.splits["train"].names
    assert len(train.dataset) == 23 and train.dataset.part.names == [
        n for n in names if n != "bar/00003.png"
    ]
    every_bar = frozenset(f"train/bar/{i:05d}.png" for i in range(8))
    with pytest.raises(UserError, match="leaves no train image of class bar"):
        source.split("train", leave_out=every_bar)


@pytest.fixture
def no_handles():
    """This process's shard handles closed: other tests' would be found open."""
    for fd in shards._handles.values():
        os.close(fd)
    shards._handles.clear()


@pytest.mark.usefixtures("no_handles")
def test_a_shard_is_opened_once_per_process_and_again_after_a_fork(tiny_packed, monkeypatch):
    opened = []
    real_open = os.open
    monkeypatch.setattr(
        shards.os, "open", lambda path, *a: opened.append(path) or real_open(path, *a)
    )
    dataset = source_at(tiny_packed).split("train").dataset
    for _ in range(2):
        for i in range(len(dataset)):
            dataset[i]
    shards_opened = sorted(path for path in opened if path.endswith(".tar"))
    assert shards_opened == [f"{tiny_packed}/train/{i:06d}.tar" for i in range(4)]
    pid = os.fork()
    if pid == 0:  # the child: its own handle, not the parent's
        reopened = len(opened)
        dataset[0]
        os._exit(0 if len(opened) == reopened + 1 else 1)
    assert os.waitpid(pid, 0)[1] == 0


@pytest.mark.usefixtures("no_handles")
def test_the_handles_kept_are_bounded(tiny_packed, monkeypatch):
    monkeypatch.setattr(shards, "OPEN_SHARDS", 2)
    dataset = source_at(tiny_packed).split("train").dataset
    for i in range(len(dataset)):
        dataset[i]
    assert len(shards._handles) <= 2


@pytest.fixture
def packed(tiny_packed, tmp_path):
    """A copy to damage."""
    return shutil.copytree(tiny_packed, tmp_path / "packed")


def test_a_truncated_shard_is_named(packed):
    shard = packed / "train" / "000002.tar"
    size = shard.stat().st_size
    os.truncate(shard, size - 1000)
    message = (
        f"DATA: shard {packed}/train/000002.tar has {size - 1000} bytes, and {packed}/index.json "
        f"says {size}"
    )
    source = source_at(packed)
    with pytest.raises(UserError, match=message):
        source.split("train")
    with pytest.raises(UserError, match=message):  # for the image check too
        source.names()


def test_a_shard_cut_short_after_the_start_is_named_with_the_image(packed):
    dataset = source_at(packed).split("train").dataset
    os.truncate(packed / "train" / "000001.tar", 1000)
    with pytest.raises(UserError, match=r"train/000001.tar: ends before image arrow/00007.png"):
        dataset[7]
    source = source_at(packed)
    with pytest.raises(UserError, match="train/000001.tar has 1000 bytes"):
        source.split("train")


def test_a_missing_shard_is_named(packed):
    (packed / "val" / "000001.tar").unlink()
    with pytest.raises(UserError, match=f"shard {packed}/val/000001.tar is missing"):
        source_at(packed).split("val")


def test_a_bad_image_in_a_shard_is_named_with_its_shard(packed):
    index = json.loads((packed / "index.json").read_text())
    name, offset, size, _ = index["splits"]["val"][0]["samples"][2]
    with open(packed / "val" / "000000.tar", "r+b") as shard:
        shard.seek(offset)
        shard.write(b"\0" * size)
    source = source_at(packed)
    assert source.problem(f"val/{name}") is not None
    dataset = source.split("val", val_transform(16)).dataset
    with pytest.raises(UserError, match=f"cannot read image {name} in {packed}/val/000000.tar: "):
        dataset[2]


def test_a_sample_larger_than_an_image_of_the_limit_is_refused_unread(packed):
    def larger(index):
        index["splits"]["train"][0]["bytes"] = 10**7
        first_sample(index)[1:3] = [0, 2 * 10**6]

    rewrite(packed, larger)
    source = shards.ShardSource.open(shards.LocalFiles(str(packed)), max_pixels=1)
    said = "image arrow/00000.png: it has 2,000,000 bytes, more than an image of "
    assert source.problem("train/arrow/00000.png").startswith(said)
    part = source.index.splits["train"]
    with pytest.raises(UserError, match=f"train/000000.tar: {said}"):
        source.load(part, 0)


def test_names_from_an_index_are_shown_escaped(packed):
    forged = "x.png\nddptrain: all images decode \x1b[2J\u202e"
    rewrite(packed, lambda index: first_sample(index).__setitem__(0, forged))
    source = source_at(packed)
    shown = f"x.png\\nddptrain: all images decode \\x1b[2J\\u202e in {packed}/train/000000.tar"
    assert source.shown(f"train/{forged}") == shown
    assert source.split("train").dataset[0][0].shape[0] == 3  # and the image is read as before


def rewrite(packed, change):
    index = json.loads((packed / "index.json").read_text())
    change(index)
    (packed / "index.json").write_text(json.dumps(index))


def first_sample(index, split="train"):
    return index["splits"][split][0]["samples"][0]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda i: i.update(format="webdataset"), "not a ddptrain packed-set index"),
        (lambda i: i.update(version=2), "index version 2; this ddptrain reads version 1"),
        (lambda i: i.update(classes=["a", "a", "b"]), '"classes" must be a list of distinct'),
        (lambda i: i.update(splits={"test": []}), '"splits" must map "train" and/or "val"'),
        (lambda i: first_sample(i).__setitem__(3, 3), r"train/000000.tar, sample 0 \(arrow/"),
        (lambda i: first_sample(i).__setitem__(3, -1), "label -1 is not one of the 3 classes"),
        (lambda i: first_sample(i).__setitem__(1, "512"), r"is not \[name, offset, size, label\]"),
        (lambda i: first_sample(i).__setitem__(2, 10**6), "lie outside the shard's 20480 bytes"),
        (lambda i: first_sample(i).__setitem__(1, -1), "bytes -1 to"),
        (lambda i: first_sample(i).pop(), r"is not \[name, offset, size, label\]"),
        (lambda i: i["splits"]["train"][0].update(shard="../x.tar"), "is not a new relative"),
        (lambda i: i["splits"]["train"][0].update(shard="/etc/x.tar"), "is not a new relative"),
        *(
            (lambda i, bad=bad: i["splits"]["train"][0].update(shard=bad), "A-Z, a-z, 0-9, '.'")
            for bad in ("train/0#1.tar", "train/0.tar?x=1", "train/%2e%2e.tar", "train//0.tar")
        ),
        (lambda i: i["splits"]["train"][1].update(shard="train/000000.tar"), "not a new"),
        (lambda i: i["splits"]["train"][0].update(bytes=-5), "bytes -5 is not a size"),
        (
            lambda i: first_sample(i).__setitem__(0, "\ud800.png"),
            r"sample 0: '\\ud800.png' is no file name's text",
        ),
        (  # escapes of the bytes of "é": a second name for "é.png"
            lambda i: first_sample(i).__setitem__(0, "\udcc3\udca9.png"),
            r"sample 0: '\\udcc3\\udca9.png' is no file name's text",
        ),
        (lambda i: i.update(classes=["a", "\ud800", "b"]), '"classes" must be a list of'),
        (lambda i: i["splits"]["val"][1].update(samples={}), "samples must be a list"),
        (
            lambda i: i["splits"]["val"][1]["samples"].append(first_sample(i, "val")),
            "sample 'arrow/00000.png' is listed twice",
        ),
    ],
)
def test_an_index_that_is_not_ours_or_malformed_is_named(packed, change, message):
    rewrite(packed, change)
    with pytest.raises(UserError, match=message) as raised:
        source_at(packed)
    assert str(raised.value).startswith(f"DATA: {packed}/index.json: ")


def test_an_index_that_is_not_json_is_named(packed):
    (packed / "index.json").write_text('{"format": "ddptrain-packed", "version": 1, "cla')
    with pytest.raises(UserError, match=f"DATA: {packed}/index.json: not JSON"):
        source_at(packed)
