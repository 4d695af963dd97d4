"""Table data sets: Parquet files as Hugging Face `datasets` writes them (`to_parquet`), in
train/ and val/, or a DatasetDict saved with `save_to_disk` (Arrow files, dataset_dict.json).

Rows are read by sample index, as a folder's files are: the sampler's seeded permutation picks
rows directly, with no shuffle buffer, so the data order, world-size invariance, exact
evaluation and bitwise resume hold as for folders; a table holding a folder's images in the
folder's order trains to the same weights. Labels are one small column, read whole at start
(and checked); images are read row by row in the loader workers, each of which opens a file
once. A Parquet row is read as part of its row group, the last of which stay in memory
(GROUPS_KEPT_BYTES); an Arrow file is mapped to memory and a row read in place.

A sample's name is `split/file:row` (`train/part-0.parquet:17`, the row within its file): what
`ddptrain check` lists, --bad-images skip leaves out and the checkpoint's digest covers.
"""

import hashlib
import os
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from torch.utils.data import Dataset

from ddptrain.config import MAX_IMAGE_PIXELS
from ddptrain.data import folder, shard_index, table_metadata
from ddptrain.data.sources import SPLITS, Split
from ddptrain.errors import UserError, first_line

DATASET_DICT = "dataset_dict.json"  # what save_to_disk writes at the top of a DatasetDict
# The Parquet row groups a process keeps, in bytes: pyarrow reads no single row of a Parquet
# file, only a row group (apache/arrow#45284), which datasets sizes at ~100 MB.
GROUPS_KEPT_BYTES = 256 << 20


def _pyarrow():
    """pyarrow, imported when a table set is opened rather than by every run: the `tables`
    extra."""
    try:
        import pyarrow.compute
        import pyarrow.ipc
        import pyarrow.parquet
    except ImportError:
        raise UserError(
            "DATA is a table set, which needs pyarrow: pip install 'ddptrain[tables]'"
        ) from None
    return pyarrow


def is_table_set(root: Path) -> bool:
    """What DATA holds, by its content: dataset_dict.json at the top, or Parquet files in
    train/ or val/ (a folder set holds class folders there)."""
    return (root / DATASET_DICT).is_file() or any(_parquet_files(root / s) for s in SPLITS)


def _parquet_files(where: Path) -> list[Path]:
    if not where.is_dir():
        return []
    return sorted(p for p in where.glob("*.parquet") if not p.name.startswith("."))


@dataclass
class _Index:
    """A split's rows: which file and row each is, and its class index."""

    folder: Path
    files: list[Path]
    file_of: np.ndarray
    row_of: np.ndarray
    labels: np.ndarray
    class_to_idx: dict[str, int]

    def names(self, split: str | None) -> list[str]:
        """Each row as `split/file:row`; as `file:row` without a split."""
        prefix = f"{split}/" if split else ""
        files = [f"{prefix}{f.relative_to(self.folder)}" for f in self.files]
        return [
            f"{files[f]}:{row}"
            for f, row in zip(self.file_of.tolist(), self.row_of.tolist(), strict=True)
        ]


@dataclass(frozen=True)
class TableSource:
    """DATA as a table set: a column of encoded images and one of class labels."""

    root: Path
    max_pixels: int = MAX_IMAGE_PIXELS
    image_column: str = "image"
    label_column: str = "label"
    _open: "_Open" = field(default_factory=lambda: _Open(), compare=False, repr=False)

    def __post_init__(self) -> None:
        _pyarrow()  # the missing extra said on opening, on every rank

    def split(self, name: str, transform=None, leave_out: frozenset[str] = frozenset()) -> Split:
        """leave_out: sample names (`names`) the image check found bad, left out."""
        index = self._index(name)
        names, labels = index.names(name), index.labels.tolist()
        kept = [i for i, row in enumerate(names) if row not in leave_out]
        # Of the `split/file:row\tlabel` lines in row order, in UTF-8 (pyarrow opens no other file
        # names); not folder.digest (sorted, without the split), which would change the digest
        # of every table checkpoint written so far and stop them resuming.
        listed = "".join(f"{names[i]}\t{labels[i]}\n" for i in kept)
        facts = {"images": len(kept), "digest": hashlib.sha256(listed.encode()).hexdigest()}
        rows = _Rows(index, np.array(kept, dtype=np.int64), self, transform)
        return Split(rows, index.class_to_idx, str(index.folder), facts)

    def names(self, splits=SPLITS, say=lambda line, stderr=False: None) -> list[str]:
        """The rows of splits as `split/file:row`, in the order training reads them."""
        return [name for split in splits for name in self._index(split).names(split)]

    def has(self, split: str) -> bool:
        listing = self.root / DATASET_DICT
        if listing.is_file():  # a malformed one is said, not taken for a missing split
            return table_metadata.split_folder(listing, split) is not None
        return bool(_parquet_files(self.root / split))

    def problem(self, name: str) -> str | None:
        """Why sample `name` cannot be used, or None when it decodes."""
        path, row = self._locate(name)
        try:
            encoded = self._open.image(path, self.image_column, row)
        except _NoImage as err:
            return str(err)
        return folder.decode_problem(encoded, self.max_pixels)

    def shown(self, name: str) -> str:
        path, row = self._locate(name)
        return f"{path}:{row}"

    def _locate(self, name: str) -> tuple[Path, int]:
        split, rest = name.split("/", 1)
        file, row = rest.rsplit(":", 1)
        return self._folder(split) / file, int(row)

    def _folder(self, split: str) -> Path:
        """The folder of ddptrain's split (train, val): a DatasetDict's may be `validation`."""
        listing = self.root / DATASET_DICT
        if not listing.is_file():
            if not _parquet_files(self.root / split):
                raise UserError(
                    f"DATA: {self.root / split} holds no Parquet files (a table set holds "
                    "train/*.parquet and val/*.parquet)"
                )
            return self.root / split
        found = table_metadata.split_folder(listing, split)
        if found is None:
            raise UserError(
                f"DATA: {listing} lists the splits {table_metadata.splits(listing)}, none of "
                f"them {' or '.join(table_metadata.SPLIT_NAMES[split])}"
            )
        return self.root / found

    def _files(self, split: str) -> tuple[Path, list[Path]]:
        where = self._folder(split)
        if not (self.root / DATASET_DICT).is_file():
            return where, _parquet_files(where)
        return where, [where / name for name in table_metadata.data_files(where)]

    def _index(self, split: str) -> _Index:
        """Reads and checks the label column of every file of the split."""
        where, files = self._files(split)
        columns, classes = [], None
        for path in files:
            table = _open_file(path)  # afresh: the files may have changed since
            _check_columns(table, path, self.image_column, self.label_column)
            try:
                columns.append(table.column(self.label_column))
            except (_pyarrow().ArrowException, OSError) as err:
                raise UserError(f"{path}: cannot read it: {first_line(err)}") from None
            named = table_metadata.class_names(table, path, self.label_column)
            if classes is not None and named != classes:
                raise UserError(f"{path}: its ClassLabel names differ from {files[0]}'s")
            classes = named
        if not sum(len(c) for c in columns):
            raise UserError(f"DATA: {where} holds no rows")
        labels, class_to_idx = _labels(columns, files, classes, self.label_column)
        file_of = np.repeat(np.arange(len(files), dtype=np.int32), [len(c) for c in columns])
        row_of = np.concatenate([np.arange(len(c), dtype=np.int64) for c in columns])
        return _Index(where, files, file_of, row_of, labels, class_to_idx)


def _check_columns(table, path: Path, image: str, label: str) -> None:
    pa = _pyarrow()
    names = table.schema.names
    for column, flag in ((image, "--image-column"), (label, "--label-column")):
        if column not in names:
            raise UserError(
                f"{path}: no column {column!r} (it has {', '.join(names)}): name it with {flag}"
            )
    kind = table.schema.field(image).type
    if pa.types.is_struct(kind) and kind.get_field_index("bytes") >= 0:
        kind = kind.field("bytes").type
    if not (pa.types.is_binary(kind) or pa.types.is_large_binary(kind)):
        raise UserError(
            f"{path}: column {image!r} holds {table.schema.field(image).type}, not encoded "
            "images (a datasets Image feature, or bytes)"
        )


def _labels(columns, files, classes, column: str) -> tuple[np.ndarray, dict[str, int]]:
    """Each row's class index, and the classes: a ClassLabel's names; without one, integers
    0..C-1 (named "0".."C-1") or strings, sorted as folder names are."""
    pa = _pyarrow()
    for path, values in zip(files, columns, strict=True):
        if values.null_count:
            row = int(np.argmax(pa.compute.is_null(values).to_numpy(zero_copy_only=False)))
            raise UserError(f"{path}:{row}: no label (null in column {column!r})")
    kind = columns[0].type
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        if classes is not None:
            raise UserError(f"{files[0]}: column {column!r} holds strings, not ClassLabel ints")
        values = [np.asarray(c.to_pylist(), dtype=object) for c in columns]
        names = sorted(set().union(*map(set, values)))
        lookup = {name: i for i, name in enumerate(names)}
        return np.array([lookup[v] for c in values for v in c], dtype=np.int64), lookup
    if not pa.types.is_integer(kind):
        raise UserError(
            f"{files[0]}: column {column!r} holds {kind}: labels are integers (a ClassLabel) "
            "or strings"
        )
    values = [c.to_numpy() for c in columns]  # as stored: a uint64 label is compared as it is
    if classes is None:
        _check_unnamed(files, values, column)
    top = len(classes) if classes is not None else 1 + max(int(v.max()) for v in values if len(v))
    bad = _first_row(files, values, lambda v: (v < 0) | (v >= top))
    if bad is not None:
        path, row, label = bad
        raise UserError(
            f"{path}:{row}: label {label} is out of range: the classes are 0..{top - 1}"
            + (" (its ClassLabel's names)" if classes is not None else "")
        )
    names = classes if classes is not None else [str(i) for i in range(top)]
    labels = np.concatenate([v.astype(np.int64) for v in values])
    return labels, {name: i for i, name in enumerate(names)}


def _check_unnamed(files, values, column: str) -> None:
    """Labels without class names make the classes 0 to the largest, so one label of 10^9
    would make a billion names: they are bounded as `pack --index-only` bounds them."""
    limit = max(sum(map(len, values)), shard_index.MAX_CLASSES)
    bad = _first_row(files, values, lambda v: v >= limit)
    if bad is not None:
        path, row, label = bad
        raise UserError(
            f"{path}:{row}: label {label}, and without a ClassLabel a label must be below "
            f"{limit:,} (the split's number of rows or {shard_index.MAX_CLASSES:,}, the "
            f"larger): give column {column!r} a ClassLabel naming the classes"
        )


def _first_row(files, values, bad) -> tuple[Path, int, int] | None:
    """The first row, in file order, whose label `bad` (a test of a file's labels) picks: its
    file, row and label; None where it picks none."""
    for path, labels in zip(files, values, strict=True):
        rows = np.flatnonzero(bad(labels))
        if len(rows):
            return path, int(rows[0]), int(labels[rows[0]])
    return None


class _NoImage(Exception):
    """Why a row gives no image bytes, for messages. Raised and caught in this module only."""


class _Rows(Dataset):
    """A split's rows (those `kept` of `index`) as (uint8 RGB image, class index), transformed."""

    jpeg_later = False  # folder.decode_rgb's: --decode-device cuda (data/decode.py)

    def __init__(self, index: _Index, kept: np.ndarray, source: TableSource, transform):
        self.index, self.kept, self.transform = index, kept, transform
        self.column, self.max_pixels = source.image_column, source.max_pixels
        self.open = _Open()

    def __len__(self) -> int:
        return len(self.kept)

    def __getitem__(self, position: int):
        encoded, shown = self._read(position)
        image = folder.decode_rgb(encoded, shown, self.max_pixels, self.jpeg_later)
        if self.transform is not None:
            image = self.transform(image)
        return image, int(self.index.labels[self.kept[position]])

    # What `ddptrain pack` reads, as of a folder.ImageFolder: names(), targets, encoded(i).

    def names(self) -> list[str]:
        """Each row's name in its split (`file:row`), in order."""
        names = self.index.names(None)
        return [names[i] for i in self.kept.tolist()]

    @property
    def targets(self) -> list[int]:
        return self.index.labels[self.kept].tolist()

    def encoded(self, position: int) -> tuple[bytes, str]:
        """The row's image as the table holds it, and the extension of its format."""
        encoded, _ = self._read(position)
        return encoded, _extension(encoded)

    def _read(self, position: int) -> tuple[bytes, str]:
        """The row's encoded image, and the row as messages name it (`file:row`)."""
        index, i = self.index, self.kept[position]
        path, row = index.files[index.file_of[i]], int(index.row_of[i])
        try:
            return self.open.image(path, self.column, row), f"{path}:{row}"
        except _NoImage as err:
            raise UserError(
                f"cannot read image {path}:{row}: {err} (`ddptrain check DATA` lists every bad "
                "image; --bad-images skip trains without them)"
            ) from None


# The formats folder.EXTENSIONS names, by their first bytes (WebP's at offset 8, after RIFF's).
_MAGIC = {
    b"\xff\xd8\xff": "jpg",
    b"\x89PNG\r\n\x1a\n": "png",
    b"GIF87a": "gif",
    b"GIF89a": "gif",
    b"BM": "bmp",
    b"II*\x00": "tif",
    b"MM\x00*": "tif",
    b"P2": "pgm",
    b"P5": "pgm",
    b"P3": "ppm",
    b"P6": "ppm",
}


def _extension(encoded: bytes) -> str:
    """The extension of an encoded image's format, told by its first bytes (a table's cell has
    no file name): `bin` for bytes of none of folder.EXTENSIONS' formats."""
    if encoded[:4] == b"RIFF" and encoded[8:12] == b"WEBP":
        return "webp"
    return next((ext for magic, ext in _MAGIC.items() if encoded.startswith(magic)), "bin")


class _Open:
    """The files one process opened, each once, and the Parquet row groups it read last. A
    loader worker, forked or spawned, opens its own: open files are not shared."""

    def __init__(self):
        self._reset()

    def _reset(self) -> None:
        self.pid, self.files, self.groups = os.getpid(), {}, OrderedDict()

    def __getstate__(self) -> dict:
        return {}

    def __setstate__(self, state: dict) -> None:
        self._reset()

    def image(self, path: Path, column: str, row: int) -> bytes:
        """The encoded image of the row."""
        if self.pid != os.getpid():
            self._reset()
        if path not in self.files:
            self.files[path] = _open_file(path)
        pa = _pyarrow()
        try:
            cell = self.files[path].cell(column, row, self.groups)
        except (pa.ArrowException, OSError) as err:  # a file damaged past its footer
            raise _NoImage(f"cannot read the row: {first_line(err)}") from None
        if not cell.is_valid:
            raise _NoImage(f"no image (null in column {column!r})")
        if hasattr(cell, "keys"):  # a datasets Image: {bytes, path}; a struct holding bytes
            if not cell["bytes"].is_valid:
                path = cell["path"].as_py() if "path" in cell else None
                only = f"only the path {path!r}" if path is not None else "nor a path"
                raise _NoImage(
                    f"no image bytes, {only}: build the Image column from bytes, so that the "
                    "table holds the images"
                )
            cell = cell["bytes"]
        return cell.as_py()


def _open_file(path: Path) -> "_Parquet | _Arrow":
    return _Arrow(path) if path.suffix == ".arrow" else _Parquet(path)


class _Parquet:
    """A Parquet file; its image column is read a row group at a time, the groups read last
    kept in `groups` (at least the last one)."""

    def __init__(self, path: Path):
        pa = _pyarrow()
        try:
            self.file = pa.parquet.ParquetFile(path)
        except (pa.ArrowException, OSError) as err:
            raise UserError(f"{path}: not a Parquet file ({first_line(err)})") from None
        self.path, self.schema = path, self.file.schema_arrow
        meta = self.file.metadata
        sizes = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
        self.starts = np.cumsum([0, *sizes])

    def column(self, name: str):
        return self.file.read(columns=[name]).column(0)

    def cell(self, name: str, row: int, groups: OrderedDict):
        group = int(np.searchsorted(self.starts, row, side="right")) - 1
        key = (self.path, group)
        values = groups.pop(key, None)
        if values is None:
            values = self.file.read_row_group(group, columns=[name]).column(0)
            kept = values.nbytes + sum(v.nbytes for v in groups.values())
            while groups and kept > GROUPS_KEPT_BYTES:
                kept -= groups.popitem(last=False)[1].nbytes
        groups[key] = values  # the most recent last
        return values[row - int(self.starts[group])]


class _Arrow:
    """An Arrow stream file (save_to_disk's), mapped to memory: rows are read in place."""

    def __init__(self, path: Path):
        pa = _pyarrow()
        try:
            self.table = pa.ipc.open_stream(pa.memory_map(str(path))).read_all()
        except (pa.ArrowException, OSError) as err:
            raise UserError(f"{path}: not an Arrow stream file ({first_line(err)})") from None
        self.schema = self.table.schema

    def column(self, name: str):
        return self.table.column(name)

    def cell(self, name: str, row: int, groups: OrderedDict):
        return self.table.column(name)[row]
