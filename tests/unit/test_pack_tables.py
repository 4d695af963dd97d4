"""`ddptrain pack` of a table set (data/tables.py): each row's bytes as the table holds them, in a
member named by the image's format, --max-side as on a folder, and a row with no image named."""

import io
import json
import tarfile

import datasets
import numpy as np
import pytest
from PIL import Image
from table_data import table_rows, with_features, write_table_set

from ddptrain.data import pack
from ddptrain.errors import UserError

FORMATS = {"JPEG": "jpg", "PNG": "png", "GIF": "gif", "WEBP": "webp", "BMP": "bmp", "TIFF": "tif"}
FORMATS |= {"PPM": "ppm"}


def encoded(fmt: str, size=(12, 8)) -> bytes:
    pixels = np.random.default_rng(0).integers(0, 256, (size[1], size[0], 3), np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, fmt)
    return out.getvalue()


def members(shard) -> dict[str, bytes]:
    with tarfile.open(shard) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers()}


def test_each_row_is_stored_as_it_is_named_by_its_format(tmp_path):
    images = [encoded(fmt) for fmt in FORMATS] + [b"no image format at all"]
    table = datasets.Dataset.from_dict({"image": images, "label": [0, 1] * 4})  # plain bytes
    write_table_set(tmp_path / "data", table)
    pack.pack(str(tmp_path / "data"), str(tmp_path / "out"), workers=0)
    stored = members(tmp_path / "out" / "train" / "000000.tar")
    exts = [*FORMATS.values(), "bin"]
    assert list(stored) == [f"{i:06d}.{e}" for i, ext in enumerate(exts) for e in (ext, "cls")]
    assert list(stored.values())[::2] == images  # byte for byte
    index = json.loads((tmp_path / "out" / "index.json").read_text())
    samples = index["splits"]["train"][0]["samples"]
    assert [(s[0], s[3]) for s in samples] == [(f"part-0.parquet:{i}", i % 2) for i in range(8)]
    assert index["classes"] == ["0", "1"]


def test_max_side_shrinks_a_table_sets_images_as_its_folders(tiny_data, tiny_parquet, tmp_path):
    pack.pack(str(tiny_data), str(tmp_path / "folder"), max_side=16, shard_size=1, workers=0)
    pack.pack(str(tiny_parquet), str(tmp_path / "table"), max_side=16, shard_size=1, workers=2)
    for split in ("train", "val"):
        shard = f"{split}/000000.tar"
        table = members(tmp_path / "table" / shard)
        assert table == members(tmp_path / "folder" / shard)
        images = [data for name, data in table.items() if name.endswith(".png")]
        assert len(images) == len(table) // 2  # each image still a PNG, 24 px made 16
        assert {Image.open(io.BytesIO(data)).size for data in images} == {(16, 16)}


def test_a_row_with_no_image_stops_pack_naming_it(tiny_data, tmp_path):
    rows, classes = table_rows(tiny_data, "val")
    rows["image"][3] = None
    write_table_set(tmp_path / "data", with_features(rows, classes))
    with pytest.raises(UserError, match=r"part-0.parquet:3: no image \(null in column 'image'\)"):
        pack.pack(str(tmp_path / "data"), str(tmp_path / "out"), workers=0)
    assert not (tmp_path / "out" / "index.json").exists()
