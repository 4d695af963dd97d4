"""The criterion: torch's label smoothing, mixup/cutmix targets that are distributions and
match their images, seeded by the step's generator, and accuracy against the dominant label."""

import pytest
import torch
import torch.nn.functional as F

from ddptrain.config import Config
from ddptrain.train.loss import Criterion, build_criterion

CLASSES = 5


def batch(n=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    images = torch.randn(n, 3, 12, 12, generator=g)
    target = torch.arange(n) % CLASSES  # neighbours differ, so each row mixes two labels
    return images, target


def step_generator(seed=0):
    return torch.Generator().manual_seed(seed)


def test_label_smoothing_equals_torchs_on_hard_and_soft_targets():
    output = torch.randn(8, CLASSES, generator=step_generator(1))
    _, target = batch()
    criterion = Criterion(CLASSES, label_smoothing=0.1)
    expected = F.cross_entropy(output, target, label_smoothing=0.1)
    assert torch.equal(criterion(output, target), expected)
    soft = torch.softmax(torch.randn(8, CLASSES, generator=step_generator(2)), 1)
    smoothed = soft * 0.9 + 0.1 / CLASSES
    by_hand = -(smoothed * output.log_softmax(1)).sum(1).mean()
    assert torch.allclose(criterion(output, soft), by_hand, atol=1e-6)


def test_without_mixing_the_batch_is_untouched():
    images, target = batch()
    criterion = build_criterion(Config(label_smoothing=0.1).optim, CLASSES)
    assert not criterion.mixes
    out_images, out_target = criterion.prepare(images, target, step_generator())
    assert out_images is images and out_target is target
    assert criterion.hard_target(target) is target


def mixing_weights(target, labels):
    """Each row's weight on its own label and on its neighbour's (the batch rolled by one)."""
    rows = torch.arange(len(labels))
    return target[rows, labels], target[rows, labels.roll(1)]


@pytest.mark.parametrize("seed", range(4))
def test_mixup_targets_are_distributions_matching_the_mixed_images(seed):
    images, labels = batch(seed=seed)
    criterion = Criterion(CLASSES, mixup_alpha=0.4)
    mixed, target = criterion.prepare(images, labels, step_generator(seed))
    assert target.shape == (8, CLASSES) and (target >= 0).all()
    assert torch.allclose(target.sum(1), torch.ones(8))
    own, other = mixing_weights(target, labels)
    assert torch.allclose(own + other, torch.ones(8))
    lam = own[0]
    assert torch.allclose(mixed, lam * images + (1 - lam) * images.roll(1, 0), atol=1e-6)


@pytest.mark.parametrize("seed", range(4))
def test_cutmix_targets_are_the_pasted_areas(seed):
    images, labels = batch(seed=seed)
    criterion = Criterion(CLASSES, cutmix_alpha=1.0)
    mixed, target = criterion.prepare(images, labels, step_generator(seed))
    assert torch.allclose(target.sum(1), torch.ones(8))
    from_neighbour = (mixed == images.roll(1, 0)).all(1) & (mixed != images).any(1)
    share = from_neighbour.float().mean((1, 2))
    _, other = mixing_weights(target, labels)
    assert torch.allclose(other, share, atol=1e-6)


def test_both_choose_mixup_or_cutmix_per_batch():
    images, labels = batch()
    criterion = build_criterion(Config(mixup_alpha=0.2, cutmix_alpha=1.0).optim, CLASSES)
    kinds = set()
    for seed in range(12):
        mixed, target = criterion.prepare(images, labels, step_generator(seed))
        assert torch.allclose(target.sum(1), torch.ones(8))
        untouched = (mixed == images).float().mean().item()
        kinds.add("cutmix" if untouched > 0.0 else "mixup")
    assert kinds == {"mixup", "cutmix"}


def test_the_step_generator_alone_decides_the_mixing():
    images, labels = batch()
    criterion = Criterion(CLASSES, mixup_alpha=0.2, cutmix_alpha=1.0)
    state = torch.get_rng_state()
    first = criterion.prepare(images, labels, step_generator(7))
    torch.manual_seed(123)  # the global generator plays no part
    again = criterion.prepare(images, labels, step_generator(7))
    other = criterion.prepare(images, labels, step_generator(8))
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    assert not torch.equal(first[1], other[1])
    torch.set_rng_state(state)
    criterion.prepare(images, labels, step_generator(7))
    assert torch.equal(torch.get_rng_state(), state)  # and it is left as it was


def test_accuracy_counts_the_dominant_label():
    images, labels = batch()
    criterion = Criterion(CLASSES, mixup_alpha=1.0)
    dominant_sample = set()
    for seed in range(8):
        _, target = criterion.prepare(images, labels, step_generator(seed))
        own, other = mixing_weights(target, labels)
        dominant_sample.add("own" if own[0] > other[0] else "neighbour")
        dominant = torch.where(own > other, labels, labels.roll(1))
        assert torch.equal(criterion.hard_target(target), dominant)
    assert dominant_sample == {"own", "neighbour"}


def test_channels_last_batches_stay_channels_last():
    images, labels = batch()
    images = images.contiguous(memory_format=torch.channels_last)
    for criterion in (Criterion(CLASSES, mixup_alpha=0.2), Criterion(CLASSES, cutmix_alpha=1.0)):
        mixed, _ = criterion.prepare(images, labels, step_generator())
        assert mixed.is_contiguous(memory_format=torch.channels_last)
