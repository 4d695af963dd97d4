"""Datasets, transform presets, the global-batch sampler and the loaders.

Data order is world-size invariant: one permutation per epoch, seeded by seed and epoch, cut
into global batches, each split in equal slices across ranks. Each sample also carries its own
augmentation seed, so sample i of epoch e is augmented the same on any rank, with any number of
loader workers.

Loaders yield uint8 images: workers decode and crop, and the batch is converted to float and
normalised on the device (`Precision.inputs`), which moves a quarter of the bytes and takes
the per-pixel float work off the loader's cores.
"""

import io
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset, Sampler, Subset
from torchvision import datasets
from torchvision.io import ImageReadMode, decode_image
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as F

from ddptrain import faults
from ddptrain.config import Config
from ddptrain.dist.env import DistEnv
from ddptrain.errors import UserError

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
DUMMY_TRAIN, DUMMY_VAL, DUMMY_CLASSES = 1_281_167, 50_000, 1000  # ImageNet's sizes


def train_transform(size: int) -> v2.Compose:
    """uint8 (3, H, W) -> uint8 (3, size, size): a random crop and flip."""
    return v2.Compose([v2.RandomResizedCrop(size, antialias=True), v2.RandomHorizontalFlip()])


def val_transform(size: int) -> v2.Compose:
    """uint8 (3, H, W) -> uint8 (3, size, size): the centre at ImageNet's 0.875 crop ratio."""
    return v2.Compose([v2.Resize(round(size / 0.875), antialias=True), v2.CenterCrop(size)])


def load_rgb(path: str) -> torch.Tensor:
    """An image file as a uint8 RGB tensor (3, H, W); names the file when it cannot be decoded.

    torchvision.io decodes JPEG, PNG, WebP and GIF straight into a tensor (the same libjpeg-turbo
    pixels as PIL, without PIL's image object and conversions); other formats (BMP, TIFF, PPM)
    and files it refuses go through PIL, whose error names what is wrong.
    """
    try:
        with open(path, "rb") as f:
            encoded = f.read()
    except OSError as err:
        raise UserError(f"cannot read image {path}: {err.strerror}") from None
    try:
        image = decode_image(
            torch.frombuffer(bytearray(encoded), dtype=torch.uint8), mode=ImageReadMode.RGB
        )
    except (RuntimeError, ValueError):  # a format torchvision does not read, or a bad file
        return _decode_with_pil(path, encoded)
    if image.ndim == 4:  # an animated GIF: its first frame, as PIL gives
        image = image[0]
    if image.dtype != torch.uint8:  # 16-bit PNG
        image = F.to_dtype(image, torch.uint8, scale=True)
    return image


def _decode_with_pil(path: str, encoded: bytes) -> torch.Tensor:
    try:
        with Image.open(io.BytesIO(encoded)) as image:
            return F.pil_to_tensor(image.convert("RGB"))
    except (OSError, SyntaxError, ValueError) as err:
        raise UserError(f"cannot read image {path}: {err}") from None


class ImageFolder(datasets.ImageFolder):
    """torchvision's ImageFolder that skips hidden folders (.ipynb_checkpoints, .Trash, ...)."""

    def find_classes(self, directory: str) -> tuple[list[str], dict[str, int]]:
        classes = sorted(
            e.name for e in os.scandir(directory) if e.is_dir() and not e.name.startswith(".")
        )
        if not classes:
            raise FileNotFoundError(f"no class folders in {directory}")
        return classes, {name: i for i, name in enumerate(classes)}


def _image_folder(root: Path, transform) -> ImageFolder:
    if not root.is_dir():
        raise UserError(f"data directory {root} does not exist (DATA must hold train/ and val/)")
    try:
        return ImageFolder(str(root), transform=transform, loader=load_rgb)
    except FileNotFoundError as err:  # no class folders, or a class folder with no images
        raise UserError(f"{root}: {err}") from None


def _check_same_classes(train: ImageFolder, val: ImageFolder) -> None:
    if train.classes != val.classes:
        only_train = sorted(set(train.classes) - set(val.classes))
        only_val = sorted(set(val.classes) - set(train.classes))
        raise UserError(
            f"class folders of {train.root} and {val.root} differ: only in train: "
            f"{only_train or 'none'}; only in val: {only_val or 'none'}"
        )


class SeededSamples(Dataset):
    """Applies each sample's own augmentation seed, delivered by the sampler with its index."""

    def __init__(self, dataset: Dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int]):
        index, seed = key
        with torch.random.fork_rng(devices=[]):
            # The CPU generator is the one transforms draw from; torch.manual_seed would also
            # seed every accelerator backend, which costs more than cropping the image.
            torch.default_generator.manual_seed(seed)
            return self.dataset[index]


def epoch_seed(seed: int, epoch: int) -> int:
    return int(np.random.SeedSequence([seed, epoch]).generate_state(1, np.uint64)[0] >> 1)


class GlobalBatchSampler(Sampler):
    """This rank's share of each global batch, as (index, augmentation seed) keys.

    The last partial global batch is dropped, so every step sees exactly `global_batch` samples
    and the same samples at any world size. `set_epoch(epoch, start_step)` resumes an epoch
    after its first `start_step` global batches, at any world size.
    """

    def __init__(self, num_samples: int, global_batch: int, rank: int, world_size: int, seed: int):
        assert global_batch % world_size == 0
        self.num_samples, self.global_batch = num_samples, global_batch
        self.rank, self.per_rank = rank, global_batch // world_size
        self.seed, self.epoch, self.start_step = seed, 0, 0

    def set_epoch(self, epoch: int, start_step: int = 0) -> None:
        assert 0 <= start_step <= self.steps
        self.epoch, self.start_step = epoch, start_step

    @property
    def steps(self) -> int:
        return self.num_samples // self.global_batch

    def __len__(self) -> int:
        return (self.steps - self.start_step) * self.per_rank

    def __iter__(self) -> Iterator[tuple[int, int]]:
        generator = torch.Generator().manual_seed(epoch_seed(self.seed, self.epoch))
        order = torch.randperm(self.num_samples, generator=generator)
        sample_seeds = torch.randint(0, 2**62, (self.num_samples,), generator=generator)
        for step in range(self.start_step, self.steps):
            faults.kill_point("data", self.epoch * self.steps + step + 1)
            start = step * self.global_batch + self.rank * self.per_rank
            for index in order[start : start + self.per_rank].tolist():
                yield index, int(sample_seeds[index])


def shard(num_samples: int, rank: int, world_size: int) -> range:
    """Contiguous, disjoint slices covering 0..num_samples once: exact evaluation, no padding."""
    return range(rank * num_samples // world_size, (rank + 1) * num_samples // world_size)


@dataclass
class Data:
    train_loader: DataLoader | None
    train_sampler: GlobalBatchSampler | None
    val_loader: DataLoader
    num_val: int
    class_to_idx: dict[str, int]

    @property
    def num_classes(self) -> int:
        return len(self.class_to_idx)


def _datasets(config: Config, data_root: Path | None):
    size = config.image_size
    if config.dummy:
        shape = (3, size, size)
        # FakeData makes PIL images: as tensors, they take the same path as decoded files.
        train = datasets.FakeData(
            DUMMY_TRAIN, shape, DUMMY_CLASSES, v2.Compose([v2.PILToTensor(), train_transform(size)])
        )
        val = datasets.FakeData(
            DUMMY_VAL,
            shape,
            DUMMY_CLASSES,
            v2.Compose([v2.PILToTensor(), val_transform(size)]),
            random_offset=1,
        )
        return train, val, {str(i): i for i in range(DUMMY_CLASSES)}
    val = _image_folder(data_root / "val", val_transform(size))
    if config.evaluate:
        return None, val, val.class_to_idx
    train = _image_folder(data_root / "train", train_transform(size))
    _check_same_classes(train, val)
    return train, val, train.class_to_idx


def build_data(config: Config, env: DistEnv, data_root: Path | None, seed: int) -> Data:
    """Loaders for this rank. `seed` orders and augments the data; equal on every rank."""
    per_rank = config.batch_size // env.world_size
    train, val, class_to_idx = _datasets(config, data_root)
    common = dict(
        num_workers=config.workers,
        pin_memory=env.device.type == "cuda",
        persistent_workers=config.workers > 0,
    )
    val_loader = DataLoader(
        Subset(val, shard(len(val), env.rank, env.world_size)), per_rank, **common
    )
    if train is None:
        return Data(None, None, val_loader, len(val), class_to_idx)
    if len(train) < config.batch_size:
        raise UserError(
            f"--batch-size {config.batch_size} is larger than the {len(train)} training images"
        )
    sampler = GlobalBatchSampler(len(train), config.batch_size, env.rank, env.world_size, seed)
    train_loader = DataLoader(SeededSamples(train), per_rank, sampler=sampler, **common)
    return Data(train_loader, sampler, val_loader, len(val), class_to_idx)
