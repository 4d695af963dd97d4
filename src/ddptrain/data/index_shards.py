"""`ddptrain pack --index-only ROOT`: the index of shards made elsewhere in the WebDataset
layout (ROOT/train/*.tar, ROOT/val/*.tar, each sample a `<key>.<image ext>` and a `<key>.cls`
holding its class index), so that ddptrain reads them as a set it packed.

Each tar is read once, headers only but for the small .cls members: tarfile gives each
member's data offset and size. Members group into samples as WebDataset groups them
(consecutive members sharing a key, the name up to the first dot of its last part); a group
with neither an image nor a .cls (metadata) is passed over. A sample's name in the index is
`<shard file>/<image member>`. Class names come from ROOT/classes.txt (one a line, in index
order) when there is one, else are the indices as strings.
"""

import contextlib
import re
import tarfile
from pathlib import Path

from ddptrain.data import folder, shard_index
from ddptrain.data.split import SPLITS
from ddptrain.errors import UserError
from ddptrain.state.files import atomic_write

KEY = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")  # WebDataset's base_plus_ext
IMAGE_EXTS = {ext[1:] for ext in folder.EXTENSIONS}
CLASSES = "classes.txt"


def index_shards(
    root: str,
    overwrite: bool = False,
    counting=lambda total, what, unit: contextlib.nullcontext(lambda n: None),
) -> str:
    """Writes ROOT/index.json for the shards below ROOT; returns the line that says so."""
    base = Path(root)
    if not base.is_dir():
        raise UserError(f"SHARDS_ROOT: {root} is not a directory")
    index = base / shard_index.INDEX
    if index.exists() and not overwrite:
        raise UserError(f"{index} exists already: pass --overwrite to write it again")
    tars = {s: sorted((base / s).glob("*.tar")) for s in SPLITS if (base / s).is_dir()}
    tars = {split: paths for split, paths in tars.items() if paths}
    if not tars:
        raise UserError(f"SHARDS_ROOT: {root} holds no train/*.tar or val/*.tar")
    classes = _classes(base / CLASSES)
    entries = {}
    with counting(sum(map(len, tars.values())), "indexing shards", "shard") as advance:
        for split, paths in tars.items():
            entries[split] = []
            for path in paths:
                if not shard_index.SAFE_PART.fullmatch(path.name):  # as the index's reader asks
                    raise UserError(f"{path}: a shard's name takes A-Z, a-z, 0-9, '.', '_', '-'")
                entries[split].append(_entry(path, f"{split}/{path.name}", classes))
                advance(1)
    labels = [s[3] for split in entries.values() for e in split for s in e["samples"]]
    limit = max(len(labels), shard_index.MAX_CLASSES)
    if classes is None and max(labels, default=-1) >= limit:
        shard, name, label = next(
            (e["shard"], s[0], s[3])
            for shards in entries.values()
            for e in shards
            for s in e["samples"]
            if s[3] >= limit
        )
        raise UserError(
            f"{shard}: the .cls of {name.split('/', 1)[1]} says class {label}, and without "
            f"{CLASSES} a label must be below {limit:,} (the number of samples or "
            f"{shard_index.MAX_CLASSES:,}, the larger): list the class names in {base / CLASSES}"
        )
    if classes is None:
        classes = [str(i) for i in range(max(labels, default=-1) + 1)]
    if not labels:
        raise UserError(f"SHARDS_ROOT: the shards of {root} hold no samples")
    atomic_write(index, shard_index.dumps(classes, entries))
    counts = ", ".join(f"{sum(len(e['samples']) for e in s)} {n}" for n, s in entries.items())
    return f"indexed {counts} images of {len(classes)} classes in {index}"


def _classes(path: Path) -> list[str] | None:
    if not path.exists():
        return None
    try:
        names = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeError) as err:
        raise UserError(f"cannot read {path}: {err}") from None
    if not names or not all(names) or len(set(names)) != len(names):
        raise UserError(f"{path}: one distinct, non-empty class name a line expected")
    return names


def _entry(path: Path, shard: str, classes: list[str] | None) -> dict:
    """The shard's index entry: its size and its samples, [name, offset, size, label]."""
    samples = []
    try:
        with tarfile.open(path, "r:") as tar:  # uncompressed only: offsets are file offsets
            group: dict[str, tarfile.TarInfo] = {}
            key = None
            for member in tar:
                found = KEY.match(member.name) if member.isreg() else None
                if found is None:
                    continue
                if found[1] != key and group:
                    samples.append(_sample(tar, shard, key, group, classes))
                    group = {}
                key, suffix = found[1], found[2].lower()
                if suffix in group:
                    raise UserError(f"{shard}: sample {key} has two .{suffix} members")
                group[suffix] = member
            if group:
                samples.append(_sample(tar, shard, key, group, classes))
    except (tarfile.TarError, OSError) as err:
        raise UserError(
            f"{path}: not a tar file ddptrain reads ({err}); it takes uncompressed tar"
        ) from None
    return {"shard": shard, "bytes": path.stat().st_size, "samples": [s for s in samples if s]}


def _sample(tar, shard: str, key: str, group: dict, classes: list[str] | None) -> list | None:
    images = sorted(suffix for suffix in group if suffix in IMAGE_EXTS)
    if not images and "cls" not in group:
        return None  # metadata of the shard, not a sample
    if len(images) != 1 or "cls" not in group:
        found = ", ".join(f".{suffix}" for suffix in group)
        raise UserError(
            f"{shard}: sample {key} has members {found}; each sample needs one image "
            f"({', '.join(sorted(IMAGE_EXTS))}) and a .cls"
        )
    text = tar.extractfile(group["cls"]).read(64)
    if group["cls"].size > 64 or not re.fullmatch(rb"\s*\d{1,18}\s*", text):
        raise UserError(f"{shard}: {group['cls'].name} holds {text[:20]!r}, not a class index")
    label = int(text)
    if classes is not None and label >= len(classes):
        raise UserError(
            f"{shard}: {group['cls'].name} says class {label}, and {CLASSES} lists "
            f"{len(classes)} classes"
        )
    image = group[images[0]]
    return [f"{shard.rsplit('/', 1)[1]}/{image.name}", image.offset_data, image.size, label]
