"""Where a run's images come from, chosen by what DATA is: an image folder (the built-in data set
is one), a packed set (data/shards.py: `ddptrain pack`'s tar shards and index), a table set
(data/tables.py) or, with --dummy, random images.

A source gives each split as a `Split` (data/split.py): a Dataset of (uint8 RGB image, class
index) pairs with the transform applied, its classes, and what a checkpoint records of it
(`facts`: count and digest, so resuming on other data is refused). For the image check
(data/check.py) it names its samples and says why one cannot be used. The loaders, the check
and the checkpoint's data facts know sources only through this, so another form of DATA is one
more class here.
"""

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from torchvision import datasets
from torchvision.transforms import v2

from ddptrain.config import MAX_IMAGE_PIXELS, Config
from ddptrain.data import folder
from ddptrain.data.remote import Remote, is_url
from ddptrain.data.shard_index import INDEX
from ddptrain.data.shards import LocalFiles, ShardSource
from ddptrain.data.split import SPLITS, Split
from ddptrain.data.synth import ensure_builtin
from ddptrain.errors import UserError

if TYPE_CHECKING:  # tables.py builds on Split, and is imported when DATA is a table set
    from ddptrain.data.tables import TableSource

DUMMY_SIZES, DUMMY_CLASSES = {"train": 1_281_167, "val": 50_000}, 1000  # ImageNet's


@dataclass(frozen=True)
class FolderSource:
    """DATA as an ImageFolder tree: train/ and val/, each a folder per class."""

    root: Path
    max_pixels: int = MAX_IMAGE_PIXELS

    def split(self, name: str, transform=None, leave_out: frozenset[str] = frozenset()) -> Split:
        """leave_out: sample names (`names`) the image check found bad, left out."""
        dataset = folder.image_folder(self.root / name, transform, self.max_pixels)
        folder.leave_out(dataset, name, leave_out)
        return Split(
            dataset,
            dataset.class_to_idx,
            dataset.root,
            folder.facts(dataset),
            folder.loose_warning(dataset),
        )

    def names(self, splits=SPLITS, say=lambda line, stderr=False: None) -> list[str]:
        """The samples of splits as `split/class/file`, in the order training reads them; says
        which images no class folder holds (training leaves them out)."""
        names = []
        for split in splits:
            dataset = folder.image_folder(self.root / split, None)
            if line := folder.loose_warning(dataset):
                say(f"warning: {line}", stderr=True)
            names += [f"{split}/{path}" for path in folder.relative_paths(dataset)]
        return names

    def has(self, split: str) -> bool:
        return (self.root / split).is_dir()

    def problem(self, name: str) -> str | None:
        """Why sample `name` cannot be used, or None when it decodes."""
        return folder.image_problem(str(self.root / name), self.max_pixels)

    def shown(self, name: str) -> str:
        return str(self.root / name)


@dataclass(frozen=True)
class DummySource:
    """--dummy: random images of ImageNet's sizes, for throughput tests."""

    image_size: int

    def split(self, name: str, transform=None, leave_out: frozenset[str] = frozenset()) -> Split:
        size = self.image_size
        # FakeData makes PIL images: as tensors, they take the same path as decoded files.
        to_tensor = v2.PILToTensor()
        dataset = datasets.FakeData(
            DUMMY_SIZES[name],
            (3, size, size),
            DUMMY_CLASSES,
            v2.Compose([to_tensor, transform]) if transform else to_tensor,
            random_offset=SPLITS.index(name),
        )
        classes = {str(i): i for i in range(DUMMY_CLASSES)}
        return Split(dataset, classes, "--dummy", {"images": len(dataset), "digest": None})


# A string for type checkers alone: TableSource is imported where DATA is a table set.
Source = "FolderSource | ShardSource | TableSource | DummySource"


def open_source(config: Config, log=None, warn=None) -> Source:
    """The source DATA names; `log` hears of the built-in data set being made, `warn(line,
    stderr)` of a URL's failed requests being tried again (in any process, on any rank)."""
    data = config.data
    if data.dummy:
        return DummySource(data.image_size)
    if data.root is None:
        return FolderSource(ensure_builtin(log=log), data.max_image_pixels)
    if is_url(data.root):
        cache_bytes = int(data.cache_size * 2**30)
        reader = Remote(data.root, data.cache_dir, cache_bytes, warn)
        return packed_at_url(reader, data.max_image_pixels)
    return source_at(Path(data.root), data.max_image_pixels, data.image_column, data.label_column)


def packed_at_url(reader: Remote, max_pixels: int = MAX_IMAGE_PIXELS) -> ShardSource:
    """A packed set at a URL: the index's own (ending in .json), or a folder holding one."""
    if reader.base.endswith(".json"):
        return ShardSource.open(*reader.at_index(), max_pixels)
    return ShardSource.open(reader, INDEX, max_pixels)


def source_at(
    root: Path,
    max_pixels: int = MAX_IMAGE_PIXELS,
    image_column: str = "image",
    label_column: str = "label",
) -> "FolderSource | ShardSource | TableSource":
    """The source of DATA `root`, by what it holds: a packed set's index (the file, or a folder
    holding index.json) makes a packed set; Parquet files in train/ or val/, or
    dataset_dict.json, a table set; train/ or val/ folders an image folder."""
    from ddptrain.data import tables  # here: tables.py imports Split from this module

    if root.suffix == ".json" and root.is_file():
        return ShardSource.open(LocalFiles(str(root.parent)), root.name, max_pixels)
    if (root / INDEX).is_file():
        return ShardSource.open(LocalFiles(str(root)), INDEX, max_pixels)
    expected = (
        "expected train/ and val/ holding class folders or Parquet files, a packed set's "
        f"{INDEX}, or a datasets DatasetDict's dataset_dict.json"
    )
    if not root.is_dir():
        raise UserError(f"DATA: {root} is not a directory ({expected})")
    if tables.is_table_set(root):
        return tables.TableSource(root, max_pixels, image_column, label_column)
    if not any((root / split).is_dir() for split in SPLITS):
        raise UserError(f"DATA: {root} is neither an image folder nor a table set ({expected})")
    return FolderSource(root, max_pixels)


def check_same_classes(train: Split, val: Split) -> None:
    if train.class_to_idx != val.class_to_idx:
        only_train = sorted(set(train.class_to_idx) - set(val.class_to_idx))
        only_val = sorted(set(val.class_to_idx) - set(train.class_to_idx))
        raise UserError(
            f"the classes of {train.where} and {val.where} differ: only in train: "
            f"{only_train or 'none'}; only in val: {only_val or 'none'}"
        )
