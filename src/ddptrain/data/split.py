"""What a data source gives for each split (data/sources.py): its own module, so that each
source's module can make one without importing the others."""

from dataclasses import dataclass, field

from torch.utils.data import Dataset

SPLITS = ("train", "val")


@dataclass
class Split:
    dataset: Dataset  # (image, class index), transformed
    class_to_idx: dict[str, int]
    where: str  # for messages: a folder or a URL
    # {"images": count, "digest": of the sample list; a packed set's "shards": {path: bytes}}
    facts: dict = field(default_factory=dict)
    warning: str | None = None  # what rank 0 says at start of the samples it leaves out
