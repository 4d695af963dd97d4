import os
import shutil

import pytest
import torch
from PIL import Image

from ddptrain.config import Config
from ddptrain.data import folder
from ddptrain.data.loaders import build_data
from ddptrain.data.sources import FolderSource, open_source
from ddptrain.data.transforms import val_transform
from ddptrain.distributed.env import DistEnv
from ddptrain.errors import UserError

ONE = DistEnv(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"))


def build(root, **overrides):
    config = Config(data=str(root), batch_size=4, workers=0, image_size=16, **overrides)
    return build_data(config, ONE, FolderSource(root), seed=0)


@pytest.fixture
def tree(tiny_data, tmp_path):
    copy = tmp_path / "data"
    shutil.copytree(tiny_data, copy)
    return copy


def test_builds_loaders_with_classes_from_the_data(tiny_data):
    d = build(tiny_data)
    assert d.class_to_idx == {"arrow": 0, "bar": 1, "circle": 2} and d.num_val == 15
    images, target = next(iter(d.train_loader))
    assert images.shape == (4, 3, 16, 16) and images.dtype == torch.uint8
    assert target.dtype == torch.int64
    assert sum(len(t) for _, t in d.val_loader) == 15


def test_val_preset_resizes_then_centre_crops():
    image = torch.zeros(3, 30, 40, dtype=torch.uint8)
    assert val_transform(32)(image).shape == (3, 32, 32)
    resize = val_transform(32).transforms[0]
    assert resize.size == [37]  # round(32 / 0.875)


def test_missing_directories(tree):
    with pytest.raises(UserError, match="does not exist"):
        build(tree / "nope")
    shutil.rmtree(tree / "val")
    with pytest.raises(UserError, match="val"):
        build(tree)


def test_empty_class_folder_is_named(tree):
    for f in (tree / "train" / "bar").iterdir():
        f.unlink()
    with pytest.raises(UserError, match="bar"):
        build(tree)


def test_a_folder_that_cannot_be_read_is_named_not_passed_over(tree, monkeypatch):
    """torchvision's own walk skipped it: its images were left out of the run in silence.
    Root reads any folder whatever its mode, so the denial is made at os.scandir."""
    hidden_away = tree / "train" / "bar" / "more"
    hidden_away.mkdir()
    shutil.copy(next((tree / "train" / "bar").glob("*.png")), hidden_away / "x.png")
    scandir = os.scandir

    def denied_below_bar(path="."):
        if os.fspath(path) == str(hidden_away):
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return scandir(path)

    monkeypatch.setattr(os, "scandir", denied_below_bar)
    with pytest.raises(UserError, match=f"Permission denied: '{hidden_away}'"):
        folder.image_folder(tree / "train", None)
    # A hidden one (another user's .Trash-1000) holds nothing to train on: it is not read.
    hidden_away = hidden_away.rename(hidden_away.with_name(".Trash-1000"))
    assert len(folder.image_folder(tree / "train", None)) == 24


def test_a_class_linked_to_nothing_is_named_not_left_out(tree):
    """A class on a disk that is not mounted, in train and val alike: it was no folder, so no
    class, and the run trained one class short without a word."""
    for split in ("train", "val"):
        shutil.rmtree(tree / split / "bar")
        (tree / split / "bar").symlink_to("/nonexistent/bar")
    with pytest.raises(UserError, match="/val: bar links to /nonexistent/bar: No such file"):
        build(tree)


def test_a_link_back_up_is_named_not_walked(tree):
    """os.walk follows `arrow/loop -> ..` down 40 levels: the images listed again and again,
    and bar's and circle's labelled arrow."""
    (tree / "train" / "arrow" / "loop").symlink_to("..")
    loop = tree / "train" / "arrow" / "loop"  # train/ again: the first class under it named
    with pytest.raises(UserError, match=rf"{loop}/(\w+) is {tree / 'train'}/\1, listed already"):
        folder.image_folder(tree / "train", None)
    # Into another class: its images would be listed under this one too.
    (tree / "train" / "arrow" / "loop").unlink()
    (tree / "train" / "arrow" / "bars").symlink_to(tree / "train" / "bar")
    bars = tree / "train" / "arrow" / "bars"
    with pytest.raises(UserError, match=f"{bars} is {tree / 'train' / 'bar'}, listed already"):
        folder.image_folder(tree / "train", None)
    # A link to a folder outside the split, listed once, is followed as before.
    bars.unlink()
    (tree / "train" / "arrow" / "more").symlink_to(tree / "val" / "arrow")
    assert len(folder.image_folder(tree / "train", None)) == 24 + 5


def test_no_class_folders(tree):
    shutil.rmtree(tree / "train")
    (tree / "train").mkdir()
    with pytest.raises(UserError, match="no class folders"):
        build(tree)


def test_mismatched_classes_are_named(tree):
    (tree / "val" / "bar").rename(tree / "val" / "ball")
    with pytest.raises(UserError, match=r"only in train: \['bar'\]; only in val: \['ball'\]"):
        build(tree)


def test_hidden_folders_are_ignored(tree):
    hidden = tree / "train" / ".ipynb_checkpoints"
    hidden.mkdir()
    shutil.copy(next((tree / "train" / "bar").iterdir()), hidden / "x.png")
    assert build(tree).num_classes == 3


def test_hidden_files_and_folders_inside_a_class_are_ignored_and_gifs_taken(tree):
    bar = tree / "train" / "bar"
    image = next(bar.iterdir())
    (bar / ".thumbnails").mkdir()
    shutil.copy(image, bar / ".thumbnails" / "x.png")  # would be counted as bar
    shutil.copy(image, bar / "._x.png")  # macOS's resource fork: not an image at all
    Image.open(image).save(bar / "x.gif")
    train = folder.image_folder(tree / "train", None)
    assert len(train) == 24 + 1 and f"{bar}/x.gif" in [path for path, _ in train.samples]
    assert FolderSource(tree).names().count("train/bar/x.gif") == 1


def test_images_in_no_class_folder_are_left_out_and_named(tree):
    image = next((tree / "val" / "bar").iterdir())
    for name in ("b.png", "a.jpg"):
        shutil.copy(image, tree / "val" / name)
    (tree / "val" / "notes.txt").write_text("not an image")
    d = build(tree)
    assert d.num_val == 15 and d.num_classes == 3
    assert d.warnings == [
        f"{tree / 'val'}: 2 image file(s) in no class folder, left out (first: a.jpg); "
        "move each into the folder of its class"
    ]
    assert build(tree, evaluate=True, pretrained=True).warnings == d.warnings
    assert folder.image_folder(tree / "train", None).loose == []
    for image in (tree / "train" / "bar").iterdir():  # the class folder poured into train/
        image.rename(tree / "train" / f"bar-{image.name}")
    (tree / "train" / "bar").rmdir()
    shutil.rmtree(tree / "val" / "bar")
    config = Config(data=str(tree), batch_size=20, workers=0, image_size=16)
    with pytest.raises(UserError, match=r"the 16 training images \(8 more in .* no class folder"):
        build_data(config, ONE, open_source(config), seed=0)


def test_a_file_that_is_not_a_regular_file_is_a_bad_image_not_a_hang(tree):
    pipe = tree / "val" / "bar" / "pipe.png"
    os.mkfifo(pipe)
    assert folder.image_problem(str(pipe)) == "not a regular file"


def test_unreadable_image_is_named(tree):
    bad = tree / "val" / "arrow" / "00000.png"
    bad.write_bytes(bad.read_bytes()[:40])  # truncated
    with pytest.raises(UserError, match="00000.png"):
        for _ in build(tree).val_loader:
            pass


def test_same_sample_same_augmentation_whatever_the_worker_count(tiny_data):
    def first_batch(workers):
        config = Config(data=str(tiny_data), batch_size=8, workers=workers, image_size=16)
        return next(iter(build_data(config, ONE, open_source(config), seed=3).train_loader))

    a, b = first_batch(0), first_batch(2)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_batch_larger_than_the_data(tiny_data):
    with pytest.raises(UserError, match="--batch-size 64"):
        build_data(
            Config(data=str(tiny_data), batch_size=64, workers=0), ONE, FolderSource(tiny_data), 0
        )
