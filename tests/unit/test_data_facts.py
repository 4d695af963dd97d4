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


def test_a_changed_shard_of_a_packed_set_is_named(tmp_path):
    """The same images packed again (other shard sizes, --max-side) keep count and digest."""
    shards = {"train/000000.tar": 20480, "train/000001.tar": 10240}
    then = {"train": {"images": 24, "digest": "d", "shards": shards}}
    check_same_data(checkpoint(then), then, tmp_path / "ckpt.pt")
    folder = {"train": {"images": 24, "digest": "d"}}  # a folder's checkpoint, on its pack
    check_same_data(checkpoint(folder), then, tmp_path / "ckpt.pt")
    for now, change in (
        ({**shards, "train/000001.tar": 30720}, "it had 10240 bytes and has 30720 now"),
        ({"train/000000.tar": 20480}, "it had 10240 bytes and is gone now"),
        ({**shards, "train/000002.tar": 512}, "train/000002.tar changed since .* \\(it was not"),
    ):
        facts = {"train": {"images": 24, "digest": "d", "shards": now}}
        with pytest.raises(UserError, match=f"DATA's train shard .*{change}"):
            check_same_data(checkpoint(then), facts, tmp_path / "ckpt.pt")
