"""The global-batch sampler: world-size invariant data order, and per-sample seeds.

One permutation per epoch, seeded by seed and epoch, cut into global batches, each split in equal
slices across ranks. Each sample also carries its own augmentation seed, so sample i of epoch e
is augmented the same on any rank, with any number of loader workers.
"""

from collections.abc import Iterator

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler


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
            start = step * self.global_batch + self.rank * self.per_rank
            for index in order[start : start + self.per_rank].tolist():
                yield index, int(sample_seeds[index])


def shard(num_samples: int, rank: int, world_size: int) -> range:
    """Contiguous, disjoint slices covering 0..num_samples once: exact evaluation, no padding."""
    return range(rank * num_samples // world_size, (rank + 1) * num_samples // world_size)


# The target of a padded val position: cross-entropy's default ignore_index, never a top-k hit.
PADDING = -100


class EvalShard(Dataset):
    """This rank's val shard, padded to the longest shard's length, so that every rank runs the
    wrapped model the same number of times (FSDP gathers parameters in every forward, DDP syncs
    buffers). A padded position repeats a real image with target PADDING, which evaluation
    masks out of the counts: every val image still counts exactly once."""

    def __init__(self, dataset: Dataset, rank: int, world_size: int):
        self.dataset = dataset
        self.indices = shard(len(dataset), rank, world_size)
        self.length = -(-len(dataset) // world_size)  # the longest shard

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, position: int):
        if position < len(self.indices):
            return self.dataset[self.indices[position]]
        image, _ = self.dataset[self.indices[-1] if self.indices else 0]
        return image, PADDING
