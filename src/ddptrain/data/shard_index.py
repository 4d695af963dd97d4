"""The index of a packed set (`ddptrain pack`): what it holds, read and checked.

index.json:
    {"format": "ddptrain-packed", "version": 1,
     "classes": [class names, in label order],
     "splits": {"train": [{"shard": "train/000000.tar", "bytes": size of the file,
                           "samples": [[name, offset, size, label], ...]}, ...],
                "val": [...]}}

Shard paths are relative to the index's folder (or URL); offset and size locate a sample's
image bytes in its shard, so a reader seeks there without parsing the tar; name is the image's
path relative to its split in the folder it was packed from (class/file). The index may come
from anywhere (a URL), so everything a reader relies on is checked here, once: a bad index
ends the run in one line instead of reading outside a shard in a loader worker.
"""

import json
import os
import re
from dataclasses import dataclass

import numpy as np

from ddptrain.data.split import SPLITS
from ddptrain.data.strings import Strings
from ddptrain.errors import UserError, printable

FORMAT, VERSION = "ddptrain-packed", 1
INDEX = "index.json"
SAFE_PART = re.compile(r"[A-Za-z0-9._-]+")  # of a shard's path: the same on a disk and in a URL
# Without class names (classes.txt to `pack --index-only`, a table's ClassLabel) the classes are
# 0 to the largest label, which must be below the number of samples or this, whichever is larger:
# a small set may hold sparse labels of a large label space (a val subset), while the class list
# stays as long as the set's samples or a few MB at most.
MAX_CLASSES = 1_000_000


@dataclass(frozen=True, eq=False)
class SplitIndex:
    """One split's samples, in order, as arrays (a million samples as Python lists would cost
    every loader worker a copy of them as it touches their reference counts)."""

    shards: list[str]  # relative paths
    shard_bytes: list[int]
    names: Strings
    shard: np.ndarray  # per sample: its shard's position in `shards`
    offset: np.ndarray
    size: np.ndarray
    label: np.ndarray

    def __len__(self) -> int:
        return len(self.names)

    def select(self, keep: np.ndarray) -> "SplitIndex":
        """The samples where keep (a boolean mask) is true, in their order."""
        names = Strings(name for name, kept in zip(self.names, keep, strict=True) if kept)
        arrays = (self.shard[keep], self.offset[keep], self.size[keep], self.label[keep])
        return SplitIndex(self.shards, self.shard_bytes, names, *arrays)


@dataclass(frozen=True, eq=False)
class Index:
    classes: list[str]
    splits: dict[str, SplitIndex]


def dumps(classes: list[str], splits: dict[str, list[dict]]) -> bytes:
    """The index file's bytes: splits maps each split to its shards' entries, as documented
    above. Compact: the samples of ImageNet take 80 MB of JSON already."""
    index = {"format": FORMAT, "version": VERSION, "classes": classes, "splits": splits}
    return json.dumps(index, separators=(",", ":")).encode() + b"\n"


def parse(raw: bytes, where: str) -> Index:
    """The index at `where` (for messages), checked; UserError naming what is wrong."""
    try:
        index = json.loads(raw)
    except (ValueError, RecursionError) as err:
        raise _bad(where, f"not JSON ({err})") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise _bad(where, f'not a ddptrain packed-set index (no "format": "{FORMAT}")')
    if index.get("version") != VERSION:
        raise _bad(
            where, f"index version {index.get('version')!r}; this ddptrain reads version {VERSION}"
        )
    classes = index.get("classes")
    if not _list_of_names(classes) or len(set(classes)) != len(classes):
        raise _bad(where, '"classes" must be a list of distinct, non-empty names')
    splits = index.get("splits")
    if not isinstance(splits, dict) or not splits or set(splits) - set(SPLITS):
        raise _bad(where, '"splits" must map "train" and/or "val" to their shards')
    return Index(
        classes, {n: _split(where, n, splits[n], len(classes)) for n in SPLITS if n in splits}
    )


def _split(where: str, split: str, entries, num_classes: int) -> SplitIndex:
    if not isinstance(entries, list) or not entries:
        raise _bad(where, f"split {split}: a list of shards expected")
    shards, sizes, names, columns = [], [], [], []
    for position, entry in enumerate(entries):
        if not isinstance(entry, dict) or set(entry) != {"shard", "bytes", "samples"}:
            raise _bad(where, f'{split} shard {position}: expected "shard", "bytes", "samples"')
        shard, size = entry["shard"], entry["bytes"]
        if not _relative(shard) or shard in shards:
            raise _bad(
                where,
                f"{split} shard {position}: {shard!r} is not a new relative path of parts of "
                "A-Z, a-z, 0-9, '.', '_', '-'",
            )
        if type(size) is not int or not 0 <= size < 2**63:
            raise _bad(where, f"{shard}: bytes {size!r} is not a size")
        found, numbers = _samples(where, shard, entry["samples"], size, num_classes)
        shards.append(shard)
        sizes.append(size)
        names += found
        columns.append(np.column_stack([np.full(len(found), position), numbers]))
    if not names:
        raise _bad(where, f"split {split} holds no samples")
    if len(set(names)) != len(names):
        seen = set()
        twice = next(name for name in names if name in seen or seen.add(name))
        raise _bad(where, f"split {split}: sample {twice!r} is listed twice")
    shard, offset, size, label = np.concatenate(columns).astype(np.int64).T
    return SplitIndex(shards, sizes, Strings(names), shard.astype(np.int32), offset, size, label)


def _samples(where: str, shard: str, samples, shard_size: int, num_classes: int):
    """One shard's sample names and (offset, size, label) rows, once each sample is known to be
    [name, offset, size, label] with its bytes inside the shard and a label of the classes."""
    if not isinstance(samples, list):
        raise _bad(where, f"{shard}: samples must be a list")
    for i, sample in enumerate(samples):
        ok = isinstance(sample, list) and len(sample) == 4 and isinstance(sample[0], str)
        if not (ok and sample[0] and all(type(v) is int for v in sample[1:])):
            raise _bad(where, f"{shard}, sample {i}: {sample!r} is not [name, offset, size, label]")
        if not _file_name(sample[0]):
            raise _bad(where, f"{shard}, sample {i}: {sample[0]!r} is no file name's text")
    # Python's integers (dtype object) until checked: JSON's may exceed 64 bits.
    numbers = np.array([s[1:] for s in samples], dtype=object).reshape(-1, 3)
    offset, size, label = numbers.T
    for i in np.flatnonzero((offset < 0) | (size < 0) | (offset + size > shard_size))[:1]:
        raise _bad(
            where,
            f"{shard}, sample {i} ({printable(samples[i][0])}): bytes {offset[i]} to "
            f"{offset[i] + size[i]} lie outside the shard's {shard_size} bytes",
        )
    for i in np.flatnonzero((label < 0) | (label >= num_classes))[:1]:
        raise _bad(
            where,
            f"{shard}, sample {i} ({printable(samples[i][0])}): label {label[i]} is not one of the "
            f"{num_classes} classes",
        )
    return [s[0] for s in samples], numbers.astype(np.int64)


def _relative(path) -> bool:
    """A path below the index's folder, the same for a disk and a URL: no way out of it, and
    parts of URL-safe characters only (`#`, `?`, `%` would make the URL another resource)."""
    if not isinstance(path, str):
        return False
    return all(SAFE_PART.fullmatch(part) and part not in (".", "..") for part in path.split("/"))


def _list_of_names(value) -> bool:
    return isinstance(value, list) and bool(value) and all(map(_file_name, value))


def _file_name(name) -> bool:
    """A non-empty string that a file name's bytes give (os.fsdecode's surrogate escapes, but
    no other lone surrogate, which could not be written to a file, a digest or a terminal, and
    no escapes of bytes that are UTF-8, which two different names would share)."""
    if not isinstance(name, str) or not name:
        return False
    try:
        return os.fsdecode(os.fsencode(name)) == name  # escapes of bytes that decode: no
    except UnicodeEncodeError:
        return False


def _bad(where: str, what: str) -> UserError:
    return UserError(f"DATA: {where}: {what} (re-pack the set with `ddptrain pack`)")
