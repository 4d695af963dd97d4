"""The run's loaders: the splits of its data source (data/sources.py), this rank's train
sampler and val shard.

Loaders yield uint8 images: workers decode and crop, and the batch is converted to float and
normalised on the device (`Precision.inputs`), which moves a quarter of the bytes and takes
the per-pixel float work off the loader's cores.
"""

import warnings
from dataclasses import dataclass, field

from ddptrain.config import Config
from ddptrain.data import decode
from ddptrain.data.sampler import EvalShard, GlobalBatchSampler, SeededSamples
from ddptrain.data.sources import Source, check_same_classes
from ddptrain.data.transforms import build_train_transform, build_val_transform
from ddptrain.data.workers import Loader
from ddptrain.distributed.env import DistEnv
from ddptrain.errors import UserError

# torch warns when one process's loader workers outnumber the cores, from every rank and again
# as each loader starts; rank 0 says it once for the node instead (threads.too_many_workers).
warnings.filterwarnings("ignore", "This DataLoader will create", UserWarning)


@dataclass
class Data:
    train_loader: Loader | decode.DecodedBatches | None
    train_sampler: GlobalBatchSampler | None
    val_loader: Loader | decode.DecodedBatches
    num_val: int
    class_to_idx: dict[str, int]
    # Per split: {"images": count, "digest": of the file list, None for --dummy}. Checkpoints
    # record it, so resuming on other data is refused (state/data_facts.py).
    facts: dict = field(default_factory=dict)
    # What rank 0 says at start about the data it leaves out (Split.warning).
    warnings: list[str] = field(default_factory=list)

    @property
    def num_classes(self) -> int:
        return len(self.class_to_idx)

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps in a training epoch (1 without training data: --evaluate)."""
        return self.train_sampler.steps if self.train_sampler else 1


def build_data(
    config: Config,
    env: DistEnv,
    source: Source,
    seed: int,
    leave_out: frozenset[str] = frozenset(),
) -> Data:
    """Loaders for this rank. `seed` orders and augments the data; equal on every rank.
    `leave_out`: samples the image check found bad (source.names), left out on every rank
    alike (data/check.py)."""
    per_rank = config.optim.batch_size // env.world_size
    on_device = config.data.decode_device == "cuda"  # decode.py; checked in resolve.py
    val_transform = build_val_transform(config.data)
    val = _split(source, "val", val_transform, leave_out, on_device)
    common = dict(
        num_workers=config.data.workers,
        pin_memory=env.device.type == "cuda",
        persistent_workers=config.data.workers > 0,
        collate_fn=decode.collate if on_device else None,
    )
    val_loader = Loader(EvalShard(val.dataset, env.rank, env.world_size), per_rank, **common)
    if on_device:
        val_loader = decode.DecodedBatches(val_loader, val_transform, env.device)
    facts = {"val": val.facts}
    if config.checkpoint.evaluate:
        warnings = [val.warning] if val.warning else []
        return Data(None, None, val_loader, len(val.dataset), val.class_to_idx, facts, warnings)
    train_transform = build_train_transform(config.data)
    train = _split(source, "train", train_transform, leave_out, on_device)
    check_same_classes(train, val)
    warnings = [line for line in (train.warning, val.warning) if line]
    images = len(train.dataset)
    if images < config.optim.batch_size:
        stray = getattr(train.dataset, "loose", [])  # an image folder's (folder.ImageFolder)
        raise UserError(
            f"--batch-size {config.optim.batch_size} is larger than the {images} training images"
            + (f" ({len(stray)} more in {train.where} sit in no class folder)" if stray else "")
        )
    sampler = GlobalBatchSampler(images, config.optim.batch_size, env.rank, env.world_size, seed)
    train_loader = Loader(SeededSamples(train.dataset), per_rank, sampler=sampler, **common)
    if on_device:
        train_loader = decode.DecodedBatches(train_loader, train_transform, env.device)
    facts["train"] = train.facts
    return Data(
        train_loader, sampler, val_loader, len(val.dataset), train.class_to_idx, facts, warnings
    )


def _split(source: Source, name: str, transform, leave_out: frozenset[str], on_device: bool):
    """The split, its transform applied in the workers; on_device (--decode-device cuda), its
    plain JPEGs left encoded for decode.DecodedBatches, which transforms them."""
    if not on_device:
        return source.split(name, transform, leave_out)
    split = source.split(name, decode.Later(transform), leave_out)
    decode.defer(split.dataset)
    return split
