"""The run's loaders: datasets from the config (image folders or --dummy), this rank's train
sampler and val shard.

Loaders yield uint8 images: workers decode and crop, and the batch is converted to float and
normalised on the device (`Precision.inputs`), which moves a quarter of the bytes and takes
the per-pixel float work off the loader's cores.
"""

import warnings
from dataclasses import dataclass, field
from pathlib import Path

from torchvision import datasets
from torchvision.transforms import v2

from ddptrain.config import Config
from ddptrain.data import folder
from ddptrain.data.folder import check_same_classes, image_folder
from ddptrain.data.sampler import EvalShard, GlobalBatchSampler, SeededSamples
from ddptrain.data.transforms import build_train_transform, build_val_transform
from ddptrain.data.workers import Loader
from ddptrain.distributed.env import DistEnv
from ddptrain.errors import UserError

DUMMY_TRAIN, DUMMY_VAL, DUMMY_CLASSES = 1_281_167, 50_000, 1000  # ImageNet's sizes

# torch warns when one process's loader workers outnumber the cores, from every rank and again
# as each loader starts; rank 0 says it once for the node instead (threads.too_many_workers).
warnings.filterwarnings("ignore", "This DataLoader will create", UserWarning)


@dataclass
class Data:
    train_loader: Loader | None
    train_sampler: GlobalBatchSampler | None
    val_loader: Loader
    num_val: int
    class_to_idx: dict[str, int]
    # Per split: {"images": count, "digest": of the file list, None for --dummy}. Checkpoints
    # record it, so resuming on other data is refused (state/data_facts.py).
    facts: dict = field(default_factory=dict)
    # What rank 0 says at start about the data it leaves out (folder.loose_warning).
    warnings: list[str] = field(default_factory=list)

    @property
    def num_classes(self) -> int:
        return len(self.class_to_idx)

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps in a training epoch (1 without training data: --evaluate)."""
        return self.train_sampler.steps if self.train_sampler else 1


def _datasets(config: Config, data_root: Path | None, leave_out: frozenset[str]):
    train_transform, val_transform = build_train_transform(config), build_val_transform(config)
    if config.dummy:
        size = config.image_size
        shape = (3, size, size)
        # FakeData makes PIL images: as tensors, they take the same path as decoded files.
        to_tensor = v2.PILToTensor()
        train = datasets.FakeData(
            DUMMY_TRAIN, shape, DUMMY_CLASSES, v2.Compose([to_tensor, train_transform])
        )
        val = datasets.FakeData(
            DUMMY_VAL,
            shape,
            DUMMY_CLASSES,
            v2.Compose([to_tensor, val_transform]),
            random_offset=1,
        )
        return train, val, {str(i): i for i in range(DUMMY_CLASSES)}
    val = image_folder(data_root / "val", val_transform, config.max_image_pixels)
    folder.leave_out(val, "val", leave_out)
    if config.evaluate:
        return None, val, val.class_to_idx
    train = image_folder(data_root / "train", train_transform, config.max_image_pixels)
    folder.leave_out(train, "train", leave_out)
    check_same_classes(train, val)
    return train, val, train.class_to_idx


def build_data(
    config: Config,
    env: DistEnv,
    data_root: Path | None,
    seed: int,
    leave_out: frozenset[str] = frozenset(),
) -> Data:
    """Loaders for this rank. `seed` orders and augments the data; equal on every rank.
    `leave_out`: files (relative to data_root) that --bad-images skip leaves out, the same on
    every rank (data/check.py)."""
    per_rank = config.batch_size // env.world_size
    train, val, class_to_idx = _datasets(config, data_root, leave_out)
    common = dict(
        num_workers=config.workers,
        pin_memory=env.device.type == "cuda",
        persistent_workers=config.workers > 0,
    )
    val_loader = Loader(EvalShard(val, env.rank, env.world_size), per_rank, **common)
    facts = {"val": _facts(val)}
    folders = [d for d in (train, val) if isinstance(d, folder.ImageFolder)]
    loose = [line for d in folders if (line := folder.loose_warning(d))]
    if train is None:
        return Data(None, None, val_loader, len(val), class_to_idx, facts, loose)
    if len(train) < config.batch_size:
        stray = getattr(train, "loose", [])  # an image folder's (folder.ImageFolder)
        raise UserError(
            f"--batch-size {config.batch_size} is larger than the {len(train)} training images"
            + (f" ({len(stray)} more in {train.root} sit in no class folder)" if stray else "")
        )
    sampler = GlobalBatchSampler(len(train), config.batch_size, env.rank, env.world_size, seed)
    train_loader = Loader(SeededSamples(train), per_rank, sampler=sampler, **common)
    facts["train"] = _facts(train)
    return Data(train_loader, sampler, val_loader, len(val), class_to_idx, facts, loose)


def _facts(dataset) -> dict:
    if isinstance(dataset, folder.ImageFolder):
        return folder.facts(dataset)
    return {"images": len(dataset), "digest": None}  # --dummy: no files
