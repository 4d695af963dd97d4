"""Bad images: each reason named, the same list with any number of workers, left out exactly."""

import contextlib
import io
import os
import shutil
from pathlib import Path

import pytest
import torch
from PIL import Image

from ddptrain.config import Config
from ddptrain.data import check, folder
from ddptrain.data.loaders import build_data
from ddptrain.data.sources import FolderSource, open_source
from ddptrain.distributed.env import DistEnv
from ddptrain.errors import UserError
from ddptrain.report.progress import counting, say

ONE = DistEnv(0, 1, 0, 1, torch.device("cpu"))


def jpeg_bytes(size=(32, 24)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, (200, 30, 30)).save(out, "JPEG")
    return out.getvalue()


@pytest.fixture
def bad_data(tiny_data, tmp_path):
    """The tiny set with a corrupt train image and a truncated val image."""
    data = shutil.copytree(tiny_data, tmp_path / "data")
    (data / "train" / "bar" / "00003.png").write_bytes(b"not an image at all")
    truncated = data / "val" / "circle" / "00001.png"
    truncated.write_bytes(truncated.read_bytes()[:200])
    return data


def test_each_kind_of_bad_image_has_its_reason(tmp_path):
    good, corrupt, truncated, bomb = (tmp_path / n for n in ("good.jpg", "c.jpg", "t.jpg", "b.jpg"))
    good.write_bytes(jpeg_bytes())
    corrupt.write_bytes(b"\xff\xd8 garbage")
    truncated.write_bytes(jpeg_bytes((64, 64))[:400])
    bomb.write_bytes(jpeg_bytes((100, 60)))
    assert folder.image_problem(str(good)) is None
    assert folder.image_problem(str(corrupt)) == "not an image in a format TorchCodec or PIL reads"
    assert folder.image_problem(str(truncated)) is not None
    assert folder.image_problem(str(bomb), max_pixels=5999) == (
        "its header declares 100 x 60 = 6,000 pixels, more than --max-image-pixels 5,999 "
        "(a decompression bomb, or raise the limit)"
    )
    assert folder.image_problem(str(bomb), max_pixels=6000) is None
    assert folder.image_problem(str(tmp_path / "gone.jpg")) == "No such file or directory"


def test_a_bomb_is_refused_before_decoding_by_training_too(tmp_path, monkeypatch):
    bomb = tmp_path / "b.jpg"
    bomb.write_bytes(jpeg_bytes((100, 60)))
    decoded = []
    monkeypatch.setattr(folder, "decode_image", lambda *a, **k: decoded.append(a))
    with pytest.raises(UserError, match=f"cannot read image {bomb}: its header declares 100 x 60"):
        folder.load_rgb(str(bomb), max_pixels=1000)
    assert decoded == []  # refused on its header alone


def test_the_bad_list_is_the_same_with_any_number_of_workers(bad_data):
    source = FolderSource(bad_data, 10**8)
    files = source.names()
    assert len(files) == 39 and files[0] == "train/arrow/00000.png" and files[-1].startswith("val/")
    expected = [
        ("train/bar/00003.png", "not an image in a format TorchCodec or PIL reads"),
        ("val/circle/00001.png", "image file is truncated"),
    ]
    for workers in (0, 2):
        assert check.find_bad(source, files, workers) == expected
    assert check.find_bad(source, files, 0, counting) == expected  # no bar off a tty


def test_the_check_counts_every_file_on_the_callers_bar(bad_data):
    bars, advanced = [], []

    @contextlib.contextmanager
    def recording(total, what, unit):
        bars.append((total, what, unit))
        yield advanced.append

    source = FolderSource(bad_data, 10**8)
    check.find_bad(source, source.names(), 0, recording)
    assert bars == [(39, "checking images", "img")] and sum(advanced) == 39


def test_check_lists_every_bad_file_then_fails_in_one_line(bad_data, capsys):
    with pytest.raises(UserError) as raised:
        check.check_command(str(bad_data), workers=0, max_image_pixels=10**8, say=say)
    listed = capsys.readouterr().out.splitlines()
    assert listed == [
        f"{bad_data}/train/bar/00003.png: not an image in a format TorchCodec or PIL reads",
        f"{bad_data}/val/circle/00001.png: image file is truncated",
    ]
    assert str(raised.value) == (
        f"2 of 39 images in {bad_data} are bad (1 of 24 train, 1 of 15 val), listed above: "
        "fix or remove them, or train with --bad-images skip"
    )


def test_check_of_good_data_says_so(tiny_data, capsys):
    check.check_command(str(tiny_data), workers=None, max_image_pixels=10**8, say=say)
    assert capsys.readouterr().out == f"all 39 images in {tiny_data} decode (24 train, 15 val)\n"


def test_check_warns_of_images_in_no_class_folder(tiny_data, tmp_path, capsys):
    data = shutil.copytree(tiny_data, tmp_path / "data")
    shutil.copy(next((data / "train" / "bar").iterdir()), data / "train" / "x.png")
    check.check_command(str(data), workers=0, max_image_pixels=10**8, say=say)
    out, err = capsys.readouterr()
    assert out == f"all 39 images in {data} decode (24 train, 15 val)\n"
    assert err == (
        f"warning: {data / 'train'}: 1 image file(s) in no class folder, left out (first: "
        "x.png); move each into the folder of its class\n"
    )


def test_data_without_val_is_refused_as_training_would(tiny_data, tmp_path):
    shutil.copytree(tiny_data / "train", tmp_path / "train")
    with pytest.raises(UserError, match=r"has no val/, which training needs; its 24 images"):
        check.check_command(str(tmp_path), workers=0, max_image_pixels=10**8)


def test_data_whose_class_folders_differ_is_refused_as_training_would(tiny_data, tmp_path):
    shutil.copytree(tiny_data, tmp_path / "data")
    (tmp_path / "data" / "val" / "bar").rename(tmp_path / "data" / "val" / "ball")
    with pytest.raises(UserError, match=r"differ: only in train: \['bar'\]; only in val: \['ball'"):
        check.check_command(str(tmp_path / "data"), workers=0, max_image_pixels=10**8)


def test_the_check_says_its_lines_through_the_caller_and_prints_nothing_itself(bad_data, capsys):
    said = []
    with pytest.raises(UserError, match="2 of 39 images"):
        check.check_command(str(bad_data), workers=0, max_image_pixels=10**8, say=said.append)
    assert said == [
        f"{bad_data}/train/bar/00003.png: not an image in a format TorchCodec or PIL reads",
        f"{bad_data}/val/circle/00001.png: image file is truncated",
    ]
    with pytest.raises(UserError, match="2 of 39 images"):
        check.check_command(str(bad_data), workers=0, max_image_pixels=10**8)  # no terminal
    assert capsys.readouterr() == ("", "")


def test_leaving_out_keeps_the_order_of_the_rest(bad_data):
    leave_out = frozenset({"train/bar/00003.png", "val/circle/00001.png"})
    config = Config(data=str(bad_data), batch_size=8, workers=0, image_size=16)
    loaders = build_data(config, ONE, open_source(config), seed=0, leave_out=leave_out)
    train = loaders.train_loader.dataset.dataset
    everything = folder.image_folder(bad_data / "train", None)
    assert train.samples == [s for s in everything.samples if not s[0].endswith("bar/00003.png")]
    assert train.targets == [label for _, label in train.samples]
    assert loaders.num_val == 14 and loaders.facts["train"]["images"] == 23
    assert loaders.train_sampler.num_samples == 23


def test_leaving_out_every_image_of_a_class_is_refused(bad_data):
    # A val class emptied so scored on nothing (every val class: no val score at all), a train
    # class emptied trained without a word: as a class folder with no image, refused.
    config = Config(data=str(bad_data), batch_size=8, workers=0, image_size=16)
    val = folder.image_folder(bad_data / "val", None)
    circles = [p for p, label in val.samples if label == val.class_to_idx["circle"]]
    every = frozenset(f"val/circle/{Path(p).name}" for p in circles)
    message = f"--bad-images skip leaves no image in {bad_data / 'val' / 'circle'} \\(1 class"
    with pytest.raises(UserError, match=message):
        build_data(config, ONE, open_source(config), seed=0, leave_out=every)


def test_verify_before_training_stops_on_a_bad_image_and_skip_leaves_it_out(bad_data, capsys):
    config = Config(data=str(bad_data), workers=0, verify_images=True)
    with pytest.raises(UserError, match=r"--verify-images: 2 of 39 images in .* are bad"):
        check.images_to_leave_out(config, ONE, say, counting)
    assert "bad image " in capsys.readouterr().err
    skip = Config(data=str(bad_data), workers=0, bad_images="skip")
    left_out = check.images_to_leave_out(skip, ONE, say, counting)
    assert left_out == {"train/bar/00003.png", "val/circle/00001.png"}
    output = capsys.readouterr()
    assert "checked 39 images: 2 bad images left out (1 of 24 train, 1 of 15 val)" in output.out
    assert output.err.count("warning: --bad-images skip: leaving out ") == 2
    assert check.images_to_leave_out(Config(data=str(bad_data)), ONE) == frozenset()  # no check


def test_bad_images_flag_values():
    with pytest.raises(UserError, match="--bad-images must be one of error, skip"):
        Config(bad_images="ignore")
    with pytest.raises(UserError, match="--max-image-pixels must be at least 1"):
        Config(max_image_pixels=0)


def test_verify_says_the_bad_files_on_stderr_and_the_verdict_on_stdout(bad_data, capsys):
    said = []
    skip = Config(data=str(bad_data), workers=0, bad_images="skip")
    left_out = check.images_to_leave_out(skip, ONE, lambda line, stderr=False: said.append(stderr))
    assert len(left_out) == 2 and said == [True, True, False]
    assert check.images_to_leave_out(skip, ONE) == left_out  # no terminal: the same, silently
    assert capsys.readouterr() == ("", "")


def test_a_file_name_that_is_not_utf8_is_listed_checked_and_digested(tiny_data, tmp_path):
    # Latin-1 names from old archives: Python holds them with surrogates, which a strict
    # .encode() refused in the file-list digests (every run failed with a traceback).
    data = shutil.copytree(tiny_data, tmp_path / "data")
    bar = data / "train" / "bar"
    facts = folder.facts(folder.image_folder(data / "train", transform=None))
    (bar / "00000.png").rename(bar / os.fsdecode(b"caf\xe9.png"))
    renamed = folder.facts(folder.image_folder(data / "train", transform=None))
    assert renamed["images"] == facts["images"] and renamed["digest"] != facts["digest"]
    config = Config(data=str(data), workers=0, verify_images=True)
    assert check.images_to_leave_out(config, ONE) == frozenset()
