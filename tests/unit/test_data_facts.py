"""Resume on changed data: the checkpoint's image counts and file-list digests must match."""

import shutil

import pytest

from ddptrain.data import folder
from ddptrain.errors import UserError
from ddptrain.state.data_facts import check_same_data


def facts_of(root):
    return folder.facts(folder.image_folder(root, transform=None))


@pytest.fixture
def data(tiny_data, tmp_path):
    return shutil.copytree(tiny_data / "train", tmp_path / "train")


def test_the_digest_is_of_relative_paths_and_labels(data, tmp_path):
    facts = facts_of(data)
    assert facts["images"] == 24 and len(facts["digest"]) == 64
    assert facts_of(shutil.copytree(data, tmp_path / "elsewhere")) == facts  # another mount
    (data / "bar" / "00000.png").rename(data / "bar" / "renamed.png")
    assert facts_of(data)["digest"] != facts["digest"]
    (data / "bar" / "renamed.png").rename(data / "circle" / "00000-moved.png")
    assert facts_of(data)["images"] == 24  # same count, other labels
    assert facts_of(data)["digest"] != facts["digest"]


def checkpoint(facts, epoch_step=0, batch=8):
    return {"data_facts": facts, "epoch_step": epoch_step, "config": {"batch_size": batch}}


def test_the_same_data_resumes(data, tmp_path):
    facts = {"train": facts_of(data), "val": {"images": 15, "digest": None}}
    check_same_data(checkpoint(facts, epoch_step=2), facts, tmp_path / "ckpt.pt")


def test_a_changed_image_count_is_named(data, tmp_path):
    saved = {"train": facts_of(data)}
    (data / "bar" / "00000.png").unlink()
    with pytest.raises(UserError, match=r"ckpt.pt was trained on 24 train images, and DATA has 23"):
        check_same_data(checkpoint(saved), {"train": facts_of(data)}, tmp_path / "ckpt.pt")


def test_the_same_count_of_other_files_is_named(data, tmp_path):
    saved = {"train": facts_of(data)}
    (data / "bar" / "00000.png").rename(data / "bar" / "other.png")
    with pytest.raises(UserError, match=r"as many train images as .*ckpt.pt .*\(24\), but other"):
        check_same_data(checkpoint(saved), {"train": facts_of(data)}, tmp_path / "ckpt.pt")


def test_a_checkpoint_without_facts_resumes_unless_its_position_is_past_the_end(tmp_path):
    old = {"epoch_step": 2, "config": {"batch_size": 8}}  # written before the facts existed
    check_same_data(old, {"train": {"images": 16, "digest": "d"}}, tmp_path / "ckpt.pt")
    with pytest.raises(UserError, match=r"step 2 of an epoch, and an epoch of DATA's 9 train"):
        check_same_data(old, {"train": {"images": 9, "digest": "d"}}, tmp_path / "ckpt.pt")
