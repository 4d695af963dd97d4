"""DATA as a packed set (`ddptrain pack`): tar shards and the index that locates each image in
them (data/shard_index.py), read by random access, so the sampler's seeded global order, exact
evaluation and bitwise resume hold as on a folder.

Every byte comes through one small reader holding the set's base: `LocalFiles` here, and
data/remote.py's `Remote` for a URL, with the same methods (url, fetch, read; and size, for the
shard check). Shard paths stay strings relative to the base, never assumed local.
"""

import os
import resource
from collections import OrderedDict
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch
from torch.utils.data import Dataset

from ddptrain.config import MAX_IMAGE_PIXELS
from ddptrain.data import folder, shard_index
from ddptrain.data.shard_index import INDEX, SplitIndex
from ddptrain.data.split import SPLITS, Split
from ddptrain.errors import UserError, printable


def _open_shards() -> int:
    """Handles a process keeps: enough for ImageNet's 550 shards of 256 MB (random access
    reads them all in turn), half the process's open-file limit at most."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return 1024 if soft == resource.RLIM_INFINITY else max(8, min(1024, soft // 2))


OPEN_SHARDS = _open_shards()


class LocalFiles:
    """The files below a folder. Each process keeps its own handles to the shards it read last
    (not one open per sample), and opens its own after a fork: a loader worker never shares
    its parent's. Holds only its base, so a dataset holding it pickles for any start method."""

    def __init__(self, base: str):
        self.base = base

    def url(self, name: str) -> str:
        """Where file `name` is, for messages."""
        return f"{self.base.rstrip('/')}/{name}"

    def size(self, name: str) -> int | None:
        """The file's size, None when there is none. Asked of every shard as a split is made:
        a handle kept to a file since replaced there (packed again) is let go."""
        path = self.url(name)
        try:
            found = os.stat(path)
        except FileNotFoundError:
            return None
        except OSError as err:
            raise UserError(f"cannot read {path}: {err.strerror}") from None
        _forget_if_replaced(path, found)
        return found.st_size

    def fetch(self, name: str) -> bytes:
        """The whole file (the index)."""
        try:
            with open(self.url(name), "rb") as f:
                return f.read()
        except FileNotFoundError:
            raise UserError(f"DATA: {self.url(name)} does not exist") from None
        except OSError as err:
            raise UserError(f"cannot read {self.url(name)}: {err.strerror}") from None

    def read(self, name: str, offset: int, size: int, whole_size: int) -> bytes:
        """size bytes at offset of file `name` (whose size the index says is whole_size);
        fewer where the file ends before."""
        path = self.url(name)
        try:
            return os.pread(_handle(path), size, offset)
        except OSError as err:
            raise UserError(f"cannot read {path}: {err.strerror}") from None


_handles: OrderedDict[str, int] = OrderedDict()  # path -> descriptor, least recently used first
_owner = os.getpid()


def _forget_if_replaced(path: str, found: os.stat_result) -> None:
    fd = _handles.get(path) if _owner == os.getpid() else None
    if fd is not None and not os.path.samestat(os.fstat(fd), found):
        os.close(_handles.pop(path))


def _handle(path: str) -> int:
    global _owner
    if _owner != os.getpid():  # a forked child: close its copies of the parent's
        for fd in _handles.values():
            os.close(fd)
        _handles.clear()
        _owner = os.getpid()
    if path in _handles:
        _handles.move_to_end(path)
        return _handles[path]
    while len(_handles) >= OPEN_SHARDS:
        os.close(_handles.popitem(last=False)[1])
    _handles[path] = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    return _handles[path]


@dataclass(frozen=True, eq=False)
class ShardSource:
    """DATA as a packed set: index.json and its shards, below the reader's base."""

    reader: LocalFiles  # or remote.Remote: the same methods
    index: shard_index.Index
    max_pixels: int = MAX_IMAGE_PIXELS
    index_name: str = INDEX

    @classmethod
    def open(
        cls, reader: LocalFiles, index_name: str = INDEX, max_pixels: int = MAX_IMAGE_PIXELS
    ) -> "ShardSource":
        """The set whose index is index_name below the reader's base, read and checked
        (shard_index.parse)."""
        index = shard_index.parse(reader.fetch(index_name), reader.url(index_name))
        return cls(reader, index, max_pixels, index_name)

    @property
    def root(self) -> str:
        """The set's folder or URL, for messages."""
        return self.reader.base

    @property
    def where(self) -> str:
        return self.reader.url(self.index_name)

    def has(self, split: str) -> bool:
        return split in self.index.splits

    def split(self, name: str, transform=None, leave_out: frozenset[str] = frozenset()) -> Split:
        """leave_out: sample names (`names`) the image check found bad, left out."""
        part = self._checked(name)
        if leave_out:
            part = self._leave_out(name, part, leave_out)
        labels = part.label.tolist()
        facts = {
            "images": len(part),
            "digest": folder.digest(zip(part.names, labels, strict=True)),
            "shards": dict(zip(part.shards, part.shard_bytes, strict=True)),
        }
        classes = {c: i for i, c in enumerate(self.index.classes)}
        images = PackedImages(self, part, transform)
        return Split(images, classes, f"{self.where} ({name})", facts)

    def names(self, splits=SPLITS, say=lambda line, stderr=False: None) -> list[str]:
        """The samples of splits as `split/name` (name: the image's path in the folder it was
        packed from), in the order training reads them."""
        names = [f"{split}/{n}" for split in splits for n in self._checked(split).names]
        self._positions  # noqa: B018 (made here, once, not in each checking worker)
        return names

    def problem(self, name: str) -> str | None:
        """Why sample `name` cannot be used, or None when it decodes."""
        part, i = self._find(name)
        encoded, why = self._read(part, i)
        return why or folder.decode_problem(encoded, self.max_pixels)

    def shown(self, name: str) -> str:
        return self.shown_at(*self._find(name))

    def shard_path(self, part: SplitIndex, i: int) -> str:
        return self.reader.url(part.shards[part.shard[i]])

    def load(self, part: SplitIndex, i: int, jpeg_later: bool = False) -> torch.Tensor:
        """Sample i of part decoded (as an image file is: folder.decode_rgb)."""
        encoded, why = self._read(part, i)
        if why:
            raise UserError(f"{self.shard_path(part, i)}: {why}")
        shown = self.shown_at(part, i)
        return folder.decode_rgb(encoded, shown, self.max_pixels, jpeg_later)

    def shown_at(self, part: SplitIndex, i: int) -> str:
        return f"{printable(part.names[i])} in {self.shard_path(part, i)}"

    def _read(self, part: SplitIndex, i: int) -> tuple[bytes, str | None]:
        offset, size, shard = int(part.offset[i]), int(part.size[i]), int(part.shard[i])
        if why := folder.too_large(size, self.max_pixels):  # unread: the index says its size
            return b"", f"image {printable(part.names[i])}: {why}"
        encoded = self.reader.read(part.shards[shard], offset, size, part.shard_bytes[shard])
        if len(encoded) == size:
            return encoded, None
        return encoded, (
            f"ends before image {printable(part.names[i])} (bytes {offset} to "
            f"{offset + size}): cut short since it was packed; pack it again"
        )

    def _checked(self, split: str) -> SplitIndex:
        """The split's index, once each of its shards is there with the size the index says:
        a shard cut short or replaced is named before any loader reads it."""
        part = self.index.splits.get(split)
        if part is None:
            raise UserError(f"DATA: {self.where} holds no {split} split")
        for shard, expected in zip(part.shards, part.shard_bytes, strict=True):
            path = self.reader.url(shard)
            size = self.reader.size(shard)
            if size is None:
                raise UserError(f"DATA: shard {path} is missing (listed in {self.where})")
            if size != expected:
                raise UserError(
                    f"DATA: shard {path} has {size} bytes, and {self.where} says {expected}: "
                    "cut short or replaced since it was packed; pack it again"
                )
        return part

    def _find(self, name: str) -> tuple[SplitIndex, int]:
        split, _, inside = name.partition("/")
        return self.index.splits[split], self._positions[split][inside]

    @cached_property
    def _positions(self) -> dict[str, dict[str, int]]:
        """Each split's sample positions by name: the image check's lookups."""
        return {s: {n: i for i, n in enumerate(p.names)} for s, p in self.index.splits.items()}

    def _leave_out(self, split: str, part: SplitIndex, names: frozenset[str]) -> SplitIndex:
        """Without the samples named (`split/name`); the others keep their order."""
        keep = np.array([f"{split}/{n}" not in names for n in part.names], dtype=bool)
        kept = part.select(keep)
        emptied = sorted(set(part.label.tolist()) - set(kept.label.tolist()))
        if emptied:  # as a folder's emptied class is refused (folder.leave_out)
            raise UserError(
                f"--bad-images skip leaves no {split} image of class "
                f"{self.index.classes[emptied[0]]} in {self.where} ({len(emptied)} class(es) "
                "emptied): every image of it is bad; replace them"
            )
        return kept


class PackedImages(Dataset):
    """A split of a packed set: (uint8 RGB image, label), the transform applied."""

    jpeg_later = False  # folder.decode_rgb's: --decode-device cuda (data/decode.py)

    def __init__(self, source: ShardSource, part: SplitIndex, transform=None):
        self.source, self.part, self.transform = source, part, transform

    def __len__(self) -> int:
        return len(self.part)

    def __getitem__(self, i: int):
        image = self.source.load(self.part, i, self.jpeg_later)
        if self.transform is not None:
            image = self.transform(image)
        return image, int(self.part.label[i])
