"""`ddptrain pack DATA OUT`: an image folder or a table set as a packed set, tar shards in the
WebDataset layout plus the index that locates each image in them (data/shard_index.py).

Per split, OUT/<split>/000000.tar, ... hold each sample as `<key>.<image ext>` and `<key>.cls`
(the class index in ASCII), the key its zero-padded number in the split, so that WebDataset's
rule (a member's key is its name up to the first dot) pairs them. Samples go in training's
order, filling each shard up to --shard-size. Both kinds of DATA give them alike: a split's
dataset (folder.ImageFolder, tables' rows) has names(), targets and encoded(i), the sample's
bytes as stored and their extension (a file's own; a table cell's, told by its format). The
output is a function of the input alone: fixed tar header fields, and -j only spreads the
reading and shrinking over processes, whose results are written in order. Without --max-side
every image is stored byte for byte, so training on the set is training on DATA, bitwise.

Nothing looks complete before it is: each shard is written under a temporary name and renamed
when done, and the index, which makes the folder a packed set, comes last (atomic_write).
"""

import contextlib
import io
import os
import re
import tarfile
from pathlib import Path

from torch.utils.data import Dataset

from ddptrain.config import PACK_QUALITY, PACK_SHARD_MB
from ddptrain.data import shard_index
from ddptrain.data.shrink import shrink
from ddptrain.data.sources import SPLITS, FolderSource, check_same_classes, source_at
from ddptrain.data.tables import TableSource
from ddptrain.data.workers import Loader
from ddptrain.distributed.threads import usable_cores
from ddptrain.errors import UserError, write_failed
from ddptrain.state.files import atomic_write, fsync_dir

MB = 1_000_000
CHUNK = 16  # images a worker reads per message
SHARD = re.compile(r"\d{6,}\.tar")  # what pack names its shards, and so may replace
PARTIAL = re.compile(r"\.\d{6,}\.tar\.\d+\.partial")  # an interrupted pack's


def pack(
    data: str,
    out: str,
    max_side: int | None = None,
    quality: int = PACK_QUALITY,
    shard_size: float = PACK_SHARD_MB,
    workers: int | None = None,
    overwrite: bool = False,
    image_column: str = "image",
    label_column: str = "label",
    say=lambda line, stderr=False: None,
    counting=lambda total, what, unit: contextlib.nullcontext(lambda n: None),
) -> str:
    """Packs DATA, an image folder or a table set, into OUT; returns the line that says what
    was written. `say` and `counting` are the caller's terminal (report.progress)."""
    _check_numbers(max_side, quality, shard_size, workers)
    source = source_at(Path(data), image_column=image_column, label_column=label_column)
    if not isinstance(source, FolderSource | TableSource):
        raise UserError(
            f"DATA: {data} is not an image folder or a table set but a packed set already (pack "
            "takes one of those)"
        )
    splits = {name: source.split(name) for name in SPLITS if source.has(name)}
    if not splits:
        raise UserError(f"DATA: {data} holds neither train/ nor val/")
    if len(splits) == 2:
        check_same_classes(splits["train"], splits["val"])  # the index has one class list
    for split in splits.values():
        if split.warning:
            say(f"warning: {split.warning}", stderr=True)
    destination = _claim(Path(out), Path(data), overwrite)
    workers = usable_cores() if workers is None else workers
    entries, unshrunk = {}, []
    for name, split in splits.items():
        reading = _Encoded(split.dataset, max_side, quality)
        loader = Loader(reading, batch_size=CHUNK, num_workers=workers, collate_fn=list)
        writer = _ShardWriter(destination / name, name, int(shard_size * MB), len(reading))
        entries[name] = _write_split(split.dataset, loader, writer, counting, unshrunk)
    _remove_stale(destination, entries)
    classes = list(next(iter(splits.values())).class_to_idx)
    atomic_write(destination / shard_index.INDEX, shard_index.dumps(classes, entries))
    if unshrunk:
        first, why = unshrunk[0]
        say(
            f"warning: {len(unshrunk)} image(s) could not be decoded to shrink, stored as they "
            f"were (first: {first}: {why}); `ddptrain check {out}` lists the bad images",
            stderr=True,
        )
    counts = ", ".join(f"{sum(len(e['samples']) for e in s)} {n}" for n, s in entries.items())
    shards = sum(len(s) for s in entries.values())
    return f"packed {counts} images of {len(classes)} classes into {shards} shards in {out}"


def _write_split(images, loader, writer, counting, unshrunk: list) -> list[dict]:
    """The split's samples (a folder.ImageFolder's or a table's rows) into its shards; returns
    their index entries, and adds to `unshrunk` the images --max-side could not shrink."""
    names, labels = images.names(), images.targets
    samples = (sample for batch in loader for sample in batch)  # in order, whatever -j
    with writer, counting(len(names), f"packing {writer.split}", "img") as advance:
        for i, (image, ext, problem) in enumerate(samples):
            writer.add(ext, image, labels[i], names[i])
            if problem:
                unshrunk.append((f"{writer.split}/{names[i]}", problem))
            advance(1)
    return writer.entries


def _check_numbers(max_side, quality, shard_size, workers) -> None:
    if max_side is not None and max_side < 1:
        raise UserError(f"--max-side must be at least 1 px, got {max_side}")
    if not 1 <= quality <= 100:
        raise UserError(f"--quality must be 1 to 100, got {quality}")
    if not shard_size > 0:
        raise UserError(f"--shard-size must be above 0 MB, got {shard_size}")
    if workers is not None and workers < 0:
        raise UserError(f"-j/--workers must be at least 0, got {workers}")


def _claim(out: Path, data: Path, overwrite: bool) -> Path:
    """OUT, made ready: a packed set there already is refused, or with --overwrite stops being
    one at once (its index removed before any shard is replaced). So are shards with no index
    (made elsewhere, or by a pack that ended before its index), which this pack would replace
    or remove; an interrupted pack's partial shards are ours to replace."""
    if out.resolve() == data.resolve():
        raise UserError(f"OUT: {out} is DATA itself; pack into another folder")
    index = out / shard_index.INDEX
    if index.exists() and not overwrite:
        raise UserError(
            f"OUT: {out} holds a packed set already ({index}): pack into another folder, or "
            "pass --overwrite to replace it"
        )
    splits = [out / split for split in shard_index.SPLITS if (out / split).is_dir()]
    shards = sorted(p for s in splits for p in s.iterdir() if SHARD.fullmatch(p.name))
    if shards and not overwrite:  # not ours to replace: made elsewhere, perhaps
        raise UserError(
            f"OUT: {out} holds shards with no index ({shards[0]}, {len(shards)} in all): pack "
            "into another folder, or pass --overwrite to replace them"
        )
    try:
        index.unlink(missing_ok=True)
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise write_failed(out, err) from None
    return out


def is_pack_file(name: str) -> bool:
    """A shard or a partial shard pack wrote, which a later pack may replace or remove."""
    return bool(SHARD.fullmatch(name) or PARTIAL.fullmatch(name))


def _remove_stale(out: Path, entries: dict[str, list[dict]]) -> None:
    """Shards of an earlier pack into OUT that this one did not write, and partial shards of
    an interrupted one: a reader that globs OUT/train/*.tar would take them."""
    written = {entry["shard"] for split in entries.values() for entry in split}
    for split in shard_index.SPLITS:
        if not (out / split).is_dir():
            continue
        for path in (out / split).iterdir():
            if is_pack_file(path.name) and f"{split}/{path.name}" not in written:
                path.unlink()


class _Encoded(Dataset):
    """Each sample's bytes and extension as the split's dataset gives them (encoded(i)),
    shrunk with --max-side, read in the loader's workers; (bytes, ext, why it could not be
    shrunk or None)."""

    def __init__(self, images: Dataset, max_side: int | None, quality: int):
        self.images, self.max_side, self.quality = images, max_side, quality

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> tuple[bytes, str, str | None]:
        encoded, ext = self.images.encoded(i)
        if self.max_side is None:
            return encoded, ext, None
        return shrink(encoded, ext, self.max_side, self.quality)


class _ShardWriter:
    """Fills one split's shards in sample order, each up to `limit` bytes (one sample at
    least), written as `.<name>.<pid>.partial` and renamed when complete. A context: on error
    the partial shard is removed."""

    def __init__(self, folder: Path, split: str, limit: int, samples: int):
        self.folder, self.split, self.limit = folder, split, limit
        self.width = max(6, len(str(samples - 1)))  # keys sort as the samples go
        self.entries: list[dict] = []
        self.count = 0
        self.file = self.tar = self.partial = None
        try:
            folder.mkdir(exist_ok=True)
        except OSError as err:
            raise write_failed(folder, err) from None

    def __enter__(self):
        return self

    def __exit__(self, kind, error, traceback) -> None:
        if kind is None:
            self._finish()
        elif self.partial is not None:
            self.file.close()
            self.partial.unlink(missing_ok=True)

    def add(self, ext: str, image: bytes, label: int, name: str) -> None:
        key = f"{self.count:0{self.width}d}"
        cls = str(label).encode()
        needed = 3 * tarfile.BLOCKSIZE + _padded(len(image)) + _padded(len(cls))
        samples = self.entries[-1]["samples"] if self.tar is not None else []
        if self.tar is None or (samples and self.tar.offset + needed > self.limit):
            self._finish()
            self._start()
        try:
            offset = self._member(f"{key}.{ext}", image)
            self._member(f"{key}.cls", cls)
        except OSError as err:
            raise write_failed(self.partial, err) from None
        self.entries[-1]["samples"].append([name, offset, len(image), label])
        self.count += 1

    def _start(self) -> None:
        shard = f"{len(self.entries):06d}.tar"
        self.partial = self.folder / f".{shard}.{os.getpid()}.partial"
        try:
            # open across add() calls: _finish or __exit__ closes it
            self.file = open(self.partial, "wb")  # noqa: SIM115
        except OSError as err:
            raise write_failed(self.partial, err) from None
        self.tar = tarfile.open(  # noqa: SIM115 (as the file)
            fileobj=self.file, mode="w", format=tarfile.USTAR_FORMAT
        )
        self.entries.append({"shard": f"{self.split}/{shard}", "bytes": 0, "samples": []})

    def _member(self, name: str, data: bytes) -> int:
        """Adds a member with fixed header fields; returns where its data starts."""
        info = tarfile.TarInfo(name)
        info.size, info.mtime, info.mode = len(data), 0, 0o644
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        header = len(info.tobuf(tarfile.USTAR_FORMAT, "utf-8", "surrogateescape"))
        start = self.tar.offset + header
        self.tar.addfile(info, io.BytesIO(data))
        return start

    def _finish(self) -> None:
        if self.tar is None:
            return
        path = self.folder / self.entries[-1]["shard"].rsplit("/", 1)[1]
        try:
            self.tar.close()  # the end-of-archive blocks
            self.file.flush()
            os.fsync(self.file.fileno())  # on disk before the index can name it
            self.entries[-1]["bytes"] = self.file.tell()
            self.file.close()
            os.replace(self.partial, path)
            fsync_dir(self.folder)
        except OSError as err:
            raise write_failed(path, err) from None
        self.tar = self.file = self.partial = None


def _padded(size: int) -> int:
    return -(-size // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE
