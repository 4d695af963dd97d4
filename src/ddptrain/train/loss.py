"""The training criterion: cross-entropy with label smoothing, on hard or mixed targets.

One `Criterion`, built once per run by `build_criterion`, used at every step:

    images, target = criterion.prepare(images, target, generator)  # after normalisation
    loss = criterion(output, target)                                # hard or soft target
    sums.add(loss, output, criterion.hard_target(target))           # train accuracy

Mixup and cutmix are torchvision's transforms v2 `MixUp` / `CutMix` (`RandomChoice` between
them when both are on), applied to each rank's batch on the training process after
normalisation: they need float images and the class count, and mixing in the loader workers
would pair only the samples a worker happens to hold. Their random draws (the Beta mixing
weight, the cutmix box, the choice between the two) come from a seed drawn from the step's
generator, so a resumed run mixes every step as the uninterrupted one did. Pairs are formed
within each rank's batch (each sample with its neighbour), as in torchvision's references.

Train accuracy with mixed targets counts a prediction right when it is the class with the
largest weight in the mixed target: the label of the sample that covers more of the mixed
image (the dominant original label; that label too when both samples share it).
"""

import torch
from torch import nn
from torchvision.transforms import v2

from ddptrain.config import OptimSettings


class Criterion(nn.Module):
    def __init__(
        self,
        num_classes: int,
        label_smoothing: float = 0.0,
        mixup_alpha: float = 0.0,
        cutmix_alpha: float = 0.0,
    ):
        super().__init__()
        self.cross_entropy = nn.CrossEntropyLoss(label_smoothing=label_smoothing)
        mixers = []
        if mixup_alpha > 0:
            mixers.append(v2.MixUp(alpha=mixup_alpha, num_classes=num_classes))
        if cutmix_alpha > 0:
            mixers.append(v2.CutMix(alpha=cutmix_alpha, num_classes=num_classes))
        self.mix = v2.RandomChoice(mixers) if len(mixers) > 1 else next(iter(mixers), None)

    @property
    def mixes(self) -> bool:
        """Whether targets become soft (class probabilities) in `prepare`."""
        return self.mix is not None

    def prepare(
        self, images: torch.Tensor, target: torch.Tensor, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch to train on: mixed images and soft targets (N, classes) with mixup or
        cutmix, else the batch itself. images: normalised float (N, C, H, W); target: class
        indices (N,). One draw from `generator` (a CPU generator) seeds the mixing."""
        if self.mix is None:
            return images, target
        seed = int(torch.randint(0, 2**62, (), generator=generator))
        layout = (
            torch.channels_last
            if images.is_contiguous(memory_format=torch.channels_last)
            else torch.contiguous_format
        )
        # MixUp and CutMix draw from the global CPU generator: fork it, so the model's own
        # randomness (dropout) does not depend on whether the batch was mixed.
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(seed)
            images, target = self.mix(images, target)
        return images.contiguous(memory_format=layout), target

    def forward(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy against class indices or class probabilities."""
        return self.cross_entropy(output, target)

    @staticmethod
    def hard_target(target: torch.Tensor) -> torch.Tensor:
        """Class indices for accuracy: a soft target's class of largest weight."""
        return target.argmax(dim=1) if target.ndim == 2 else target


def build_criterion(config: OptimSettings, num_classes: int) -> Criterion:
    return Criterion(num_classes, config.label_smoothing, config.mixup_alpha, config.cutmix_alpha)
