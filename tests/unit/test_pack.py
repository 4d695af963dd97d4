"""`ddptrain pack`: the WebDataset layout, the index, byte-for-byte samples, the same bytes
whatever -j, nothing complete-looking after a failure, --max-side, and --index-only."""

import io
import json
import shutil
import tarfile

import numpy as np
import pytest
import torch
import webdataset as wds
from PIL import Image

from ddptrain.data import folder, pack
from ddptrain.data.index_shards import index_shards
from ddptrain.data.shards import ShardSource
from ddptrain.data.sources import source_at
from ddptrain.errors import UserError


def members_of(shard) -> list[tarfile.TarInfo]:
    with tarfile.open(shard) as tar:
        return tar.getmembers()


def files_below(root) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_each_sample_is_its_file_byte_for_byte_at_the_indexed_offset(tiny_data, tiny_packed):
    index = json.loads((tiny_packed / "index.json").read_text())
    assert (index["format"], index["version"]) == ("ddptrain-packed", 1)
    assert index["classes"] == ["arrow", "bar", "circle"]
    for split, count, shards in (("train", 24, 4), ("val", 15, 2)):
        entries = index["splits"][split]
        assert [e["shard"] for e in entries] == [f"{split}/{i:06d}.tar" for i in range(shards)]
        samples = [s for e in entries for s in e["samples"]]
        listed = folder.image_folder(tiny_data / split, None)
        assert [s[0] for s in samples] == folder.relative_paths(listed)  # the folder's order
        assert [s[3] for s in samples] == listed.targets
        assert len(samples) == count
        number = 0
        for entry in entries:
            shard = tiny_packed / entry["shard"]
            assert shard.stat().st_size == entry["bytes"]
            members = members_of(shard)
            assert [m.name for m in members] == [
                f"{number + i:06d}.{ext}"
                for i in range(len(entry["samples"]))
                for ext in ("png", "cls")
            ]
            for m in members:
                assert (m.mtime, m.uid, m.gid, m.uname, m.gname, m.mode) == (0, 0, 0, "", "", 0o644)
            data = shard.read_bytes()
            for (name, offset, size, label), image, cls in zip(
                entry["samples"], members[::2], members[1::2], strict=True
            ):
                assert (image.offset_data, image.size) == (offset, size)
                assert data[offset : offset + size] == (tiny_data / split / name).read_bytes()
                assert data[cls.offset_data : cls.offset_data + cls.size] == str(label).encode()
            number += len(entry["samples"])


def test_webdataset_reads_every_sample_with_its_class(tiny_data, tiny_packed):
    index = json.loads((tiny_packed / "index.json").read_text())
    for split in ("train", "val"):
        urls = [str(tiny_packed / e["shard"]) for e in index["splits"][split]]
        read = wds.WebDataset(urls, shardshuffle=False).decode("torchrgb8").to_tuple("png", "cls")
        samples = list(read)
        listed = folder.image_folder(tiny_data / split, None)
        assert [label for _, label in samples] == listed.targets
        for (image, _), (path, _) in zip(samples, listed.samples, strict=True):
            assert torch.equal(image, folder.load_rgb(path))


def test_the_same_bytes_whatever_the_workers(tiny_data, tiny_packed, tmp_path):
    pack.pack(str(tiny_data), str(tmp_path / "j2"), shard_size=0.02, workers=2)
    assert files_below(tmp_path / "j2") == files_below(tiny_packed)


def test_a_packed_set_is_not_packed_over_without_overwrite(tiny_data, tiny_packed, tmp_path):
    out = shutil.copytree(tiny_packed, tmp_path / "out")
    before = files_below(out)
    with pytest.raises(UserError, match=r"holds a packed set already .*--overwrite"):
        pack.pack(str(tiny_data), str(out), workers=0)
    assert files_below(out) == before
    # Bigger shards: the earlier set's extra shards go, so that a glob finds this set alone.
    pack.pack(str(tiny_data), str(out), shard_size=1, workers=0, overwrite=True)
    assert sorted(p.name for p in (out / "train").iterdir()) == ["000000.tar"]
    assert len(source_at(out).split("train").dataset) == 24


def test_shards_made_elsewhere_are_not_packed_over_without_overwrite(tiny_data, tmp_path):
    out = tmp_path / "out"
    (out / "train").mkdir(parents=True)
    for name in ("000000.tar", "000001.tar", "000002.tar", "000003.tar", "000004.tar"):
        (out / "train" / name).write_bytes(tar_of({"x.png": b"theirs", "x.cls": b"0"}))
    before = files_below(out)
    with pytest.raises(UserError) as raised:
        pack.pack(str(tiny_data), str(out), shard_size=0.02, workers=0)
    assert str(raised.value) == (
        f"OUT: {out} holds shards with no index ({out}/train/000000.tar, 5 in all): pack into "
        "another folder, or pass --overwrite to replace them"
    )
    assert files_below(out) == before
    pack.pack(str(tiny_data), str(out), shard_size=0.02, workers=0, overwrite=True)
    assert not (out / "train" / "000004.tar").exists()  # theirs, replaced as asked


def test_an_interrupted_packs_partial_shards_are_replaced(tiny_data, tiny_packed, tmp_path):
    out = tmp_path / "out"
    (out / "train").mkdir(parents=True)
    (out / "train" / ".000000.tar.123.partial").write_bytes(b"cut short")
    pack.pack(str(tiny_data), str(out), shard_size=0.02, workers=0)
    assert files_below(out) == files_below(tiny_packed)


def test_a_pack_that_fails_leaves_no_index_and_no_partial_shard(tiny_data, tmp_path, monkeypatch):
    read = pack._Encoded.__getitem__

    def failing(self, i):
        if i == 5 and len(self) == 15:  # in val, after train's shards are complete
            raise UserError("cannot read val/bar/00000.png: Input/output error")
        return read(self, i)

    monkeypatch.setattr(pack._Encoded, "__getitem__", failing)
    with pytest.raises(UserError, match="Input/output error"):
        pack.pack(str(tiny_data), str(tmp_path / "out"), shard_size=0.02, workers=0)
    left = sorted(str(p.relative_to(tmp_path / "out")) for p in (tmp_path / "out").rglob("*"))
    assert "index.json" not in left and not [p for p in left if "partial" in p]
    assert not isinstance(source_at(tmp_path / "out"), ShardSource)  # not a set


def test_bad_numbers_and_a_packed_data_are_refused(tiny_packed, tmp_path):
    for flags, message in (
        ({"max_side": 0}, "--max-side must be at least 1"),
        ({"quality": 101}, "--quality must be 1 to 100"),
        ({"shard_size": 0}, "--shard-size must be above 0"),
    ):
        with pytest.raises(UserError, match=message):
            pack.pack(str(tiny_packed), str(tmp_path / "out"), **flags)
    with pytest.raises(UserError, match="is not an image folder"):
        pack.pack(str(tiny_packed), str(tmp_path / "out"))


def image_bytes(size, mode="RGB", fmt="PNG") -> bytes:
    pixels = np.random.default_rng(0).integers(0, 256, (size[1], size[0], len(mode)), np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels.squeeze(), mode if mode != "L" else None).save(out, fmt)
    return out.getvalue()


def test_max_side_shrinks_longer_images_only(tmp_path):
    data = tmp_path / "data"
    files = {
        "a/big.JPEG": image_bytes((200, 100), fmt="JPEG"),
        "a/alpha.png": image_bytes((60, 120), "RGBA"),
        "b/small.png": image_bytes((40, 20)),
        "b/broken.jpg": image_bytes((200, 100), fmt="JPEG")[:300],
    }
    for name, content in files.items():
        (data / "train" / name).parent.mkdir(parents=True, exist_ok=True)
        (data / "train" / name).write_bytes(content)
    said = []
    pack.pack(
        str(data),
        str(tmp_path / "out"),
        max_side=50,
        workers=0,
        say=lambda *a, **k: said.append(a[0]),
    )
    shard = tmp_path / "out" / "train" / "000000.tar"
    members = members_of(shard)[::2]
    assert [m.name for m in members] == ["000000.png", "000001.jpg", "000002.jpg", "000003.png"]
    data = shard.read_bytes()
    names = source_at(tmp_path / "out").index.splits["train"].names
    pairs = zip(names, members, strict=True)
    stored = {n: data[m.offset_data : m.offset_data + m.size] for n, m in pairs}
    big = Image.open(io.BytesIO(stored["a/big.JPEG"]))
    assert (big.format, big.size) == ("JPEG", (50, 25))
    alpha = Image.open(io.BytesIO(stored["a/alpha.png"]))
    assert (alpha.format, alpha.size, alpha.mode) == ("PNG", (25, 50), "RGB")
    # Lossless: the pixels training decodes from the file, resized, nothing else.
    expected = Image.open(io.BytesIO(files["a/alpha.png"])).convert("RGB")
    assert np.array_equal(
        np.asarray(alpha), np.asarray(expected.resize((25, 50), Image.Resampling.LANCZOS))
    )
    assert stored["b/small.png"] == files["b/small.png"]  # never enlarged, nor encoded again
    assert stored["b/broken.jpg"] == files["b/broken.jpg"]  # kept for the check to name
    assert len(said) == 1 and "1 image(s) could not be decoded to shrink" in said[0]
    assert "train/b/broken.jpg" in said[0]


def test_index_only_indexes_shards_made_elsewhere(tiny_packed, tmp_path):
    shards = shutil.copytree(tiny_packed, tmp_path / "shards")
    (shards / "index.json").unlink()
    line = index_shards(str(shards))
    assert line == f"indexed 24 train, 15 val images of 3 classes in {shards / 'index.json'}"
    ours, theirs = source_at(tiny_packed), source_at(shards)
    assert theirs.index.classes == ["0", "1", "2"]  # no classes.txt
    mine, found = ours.index.splits["train"], theirs.index.splits["train"]
    assert found.names[:2] == ["000000.tar/000000.png", "000000.tar/000001.png"]
    for column in ("shard", "offset", "size", "label"):
        assert np.array_equal(getattr(mine, column), getattr(found, column))
    with pytest.raises(UserError, match="exists already: pass --overwrite"):
        index_shards(str(shards))
    (shards / "classes.txt").write_text("arrow\nbar\ncircle\n")
    index_shards(str(shards), overwrite=True)
    assert source_at(shards).index.classes == ["arrow", "bar", "circle"]


def tar_of(members: dict[str, bytes]) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


@pytest.mark.parametrize(
    ("members", "message"),
    [
        ({"a.png": b"x"}, r"train/0.tar: sample a has members .png; each sample needs one image"),
        ({"a.png": b"x", "a.cls": b"one"}, r"train/0.tar: a.cls holds b'one', not a class index"),
        ({"a.png": b"x", "a.cls": b"3"}, r"a.cls says class 3, and classes.txt lists 3 classes"),
        ({"a.png": b"x", "a.jpg": b"x", "a.cls": b"0"}, r"sample a has members .png, .jpg, .cls"),
    ],
)
def test_index_only_names_the_shard_and_member_of_a_bad_sample(tmp_path, members, message):
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "0.tar").write_bytes(tar_of({"__meta__.json": b"{}", **members}))
    (tmp_path / "classes.txt").write_text("x\ny\nz\n")
    with pytest.raises(UserError, match=message):
        index_shards(str(tmp_path))
    assert not (tmp_path / "index.json").exists()


def test_index_only_bounds_the_classes_it_makes_without_classes_txt(tmp_path):
    (tmp_path / "train").mkdir()
    big = {"a.png": b"x", "a.cls": b"0", "b.png": b"x", "b.cls": b"999999999999999999"}
    (tmp_path / "train" / "0.tar").write_bytes(tar_of(big))
    with pytest.raises(UserError) as raised:
        index_shards(str(tmp_path))
    assert str(raised.value) == (
        "train/0.tar: the .cls of b.png says class 999999999999999999, and without classes.txt "
        "a label must be below 1,000,000 (the number of samples or 1,000,000, the larger): list "
        f"the class names in {tmp_path / 'classes.txt'}"
    )
    assert not (tmp_path / "index.json").exists()
    # Sparse labels of a small set are taken: a val subset of a large label space.
    (tmp_path / "train" / "0.tar").write_bytes(tar_of({**big, "b.cls": b"9"}))
    assert index_shards(str(tmp_path)).startswith("indexed 2 train images of 10 classes")


def test_index_only_refuses_a_shard_name_unsafe_in_a_url(tiny_packed, tmp_path):
    shards = shutil.copytree(tiny_packed, tmp_path / "shards")
    (shards / "index.json").unlink()
    (shards / "val" / "000001.tar").rename(shards / "val" / "0#1.tar")
    with pytest.raises(UserError, match=r"val/0#1.tar: a shard's name takes A-Z, a-z, 0-9"):
        index_shards(str(shards))


def test_index_only_refuses_a_compressed_tar(tmp_path):
    import gzip

    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "0.tar").write_bytes(
        gzip.compress(tar_of({"a.png": b"x", "a.cls": b"0"}))
    )
    with pytest.raises(UserError, match="it takes uncompressed tar"):
        index_shards(str(tmp_path))
