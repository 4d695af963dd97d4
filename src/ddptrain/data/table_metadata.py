"""What `datasets` writes beside a table set's files and inside them, read and checked: a
DatasetDict's dataset_dict.json (its splits) and each split's state.json (its Arrow files), and
the features in a file's schema metadata (a label column's ClassLabel names). They may come from
anywhere, so each is checked for the shape datasets writes: anything else is one line naming
the file.
"""

import json
from pathlib import Path

from ddptrain.errors import UserError, first_line

# What a DatasetDict may call ddptrain's splits: its val may be `validation`.
SPLIT_NAMES = {"train": ("train",), "val": ("validation", "val")}


def splits(listing: Path) -> list[str]:
    """The split names dataset_dict.json lists."""
    return saved_list(listing, "splits", str, "split names")


def split_folder(listing: Path, split: str) -> str | None:
    """The folder of ddptrain's split (train, val) that dataset_dict.json lists, or None."""
    listed = splits(listing)
    return next((name for name in SPLIT_NAMES[split] if name in listed), None)


def data_files(folder: Path) -> list[str]:
    """The Arrow files of a saved split, as its state.json lists them: file names in its
    folder (nothing outside it is read), each once (a row is named by its file and row)."""
    state = folder / "state.json"
    listed = saved_list(state, "_data_files", dict, '{"filename": NAME} objects')
    names = [entry.get("filename") for entry in listed]
    for name in names:
        if not isinstance(name, str) or name in ("", ".", "..") or Path(name).name != name:
            raise UserError(f"DATA: {state} lists {name!r}, not a file name in {folder}")
    twice = repeated(names)
    if twice is not None:
        raise UserError(f"DATA: {state} lists {twice!r} twice: each file of the split is read once")
    return names


def saved_list(path: Path, key: str, kind: type, what: str) -> list:
    """The list under `key` of one of save_to_disk's JSON files (an object), each item a kind."""
    loaded = read_json(path)
    listed = loaded.get(key) if isinstance(loaded, dict) else None
    if not isinstance(listed, list) or not all(isinstance(item, kind) for item in listed):
        raise UserError(
            f'DATA: {path} lists no {key} (save_to_disk writes an object whose "{key}" is a '
            f"list of {what}): save the set again with save_to_disk"
        )
    return listed


def repeated(items: list):
    """The first of items (hashable) listed a second time; None where each is listed once."""
    seen = set()
    return next((item for item in items if item in seen or seen.add(item)), None)


def read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as err:  # deep nesting: RecursionError
        raise UserError(f"DATA: cannot read {path}: {first_line(err)}") from None


def class_names(table, path: Path, column: str) -> list[str] | None:
    """The ClassLabel names of the label column; None without a ClassLabel. Distinct: classes
    are looked up by name, so a repeated one would make fewer classes than the labels use."""
    feature = _feature(table, path, column)
    if feature is None or feature.get("_type") != "ClassLabel":
        return None
    names = feature.get("names")
    if not isinstance(names, list) or not names:
        raise UserError(
            f'{path}: the ClassLabel of column {column!r} has no list of class names ("names"): '
            "give it the names, as datasets.ClassLabel(names=[...]) writes them"
        )
    for name in names:
        if not isinstance(name, str) or not name:
            raise _misnamed(path, column, f"has the class name {name!r}")
    twice = repeated(names)
    if twice is not None:
        raise _misnamed(path, column, f"names {twice!r} twice")
    return names


def _misnamed(path: Path, column: str, what: str) -> UserError:
    return UserError(
        f"{path}: the ClassLabel of column {column!r} {what}: give each class one distinct, "
        "non-empty name"
    )


def _feature(table, path: Path, column: str) -> dict | None:
    """The column's feature among those datasets keeps in the schema's metadata (JSON under key
    `huggingface`: info.features.COLUMN). A key left out means no feature, as datasets reads
    them; a value of another shape is refused rather than passed over."""
    raw = (table.schema.metadata or {}).get(b"huggingface")
    if raw is None:
        return None
    at = "huggingface"
    try:
        node = json.loads(raw)
    except (ValueError, RecursionError):
        node = None  # not JSON: refused below, as no object
    for key in ("info", "features", column):
        if not isinstance(node, dict):
            raise _not_features(path, at)
        node, at = node.get(key), f"{at}.{key}"
        if node is None:
            return None
    if not isinstance(node, dict):
        raise _not_features(path, at)
    return node


def _not_features(path: Path, at: str) -> UserError:
    return UserError(
        f"{path}: the schema metadata {at} is not a JSON object as datasets writes it: write the "
        "file with datasets, or without the 'huggingface' metadata"
    )
