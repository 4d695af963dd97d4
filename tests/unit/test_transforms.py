"""Config-driven train and val transforms: the classic presets by default, each augmentation
flag where torchvision puts it, on uint8, and the same for the same sample seed."""

import pytest
import torch
from torch.utils.data import Dataset
from torchvision.transforms import v2

from ddptrain.config import Config
from ddptrain.data.loaders import build_data
from ddptrain.data.sampler import SeededSamples
from ddptrain.data.sources import open_source
from ddptrain.data.transforms import (
    MEAN_UINT8,
    build_train_transform,
    build_val_transform,
    train_transform,
    val_sizes,
    val_transform,
)
from ddptrain.distributed.env import DistEnv

ONE = DistEnv(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"))


def picture(height=60, width=80, seed=0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (3, height, width), dtype=torch.uint8, generator=generator)


def drawn(transform, image, seed):
    torch.manual_seed(seed)
    return transform(image)


def test_the_defaults_are_todays_classic_presets_draw_for_draw():
    image = picture()
    for size in (16, 32, 48):
        config = Config(image_size=size)
        for seed in range(8):
            new = drawn(build_train_transform(config.data), image, seed)
            assert torch.equal(new, drawn(train_transform(size), image, seed))
        assert torch.equal(build_val_transform(config.data)(image), val_transform(size)(image))
        assert val_sizes(config.data) == (round(size / 0.875), size)


def test_crop_scale_ratio_and_interpolation_reach_the_crop():
    config = Config(crop_scale=(0.5, 0.9), crop_ratio=(1.0, 1.0), interpolation="bicubic")
    crop = build_train_transform(config.data).transforms[0]
    assert isinstance(crop, v2.RandomResizedCrop)
    assert (crop.scale, crop.ratio) == ((0.5, 0.9), (1.0, 1.0))
    assert crop.interpolation == v2.InterpolationMode.BICUBIC
    # A full-image, square crop of a square picture is a plain resize.
    whole = Config(image_size=16, crop_scale=(1.0, 1.0), crop_ratio=(1.0, 1.0), hflip=0.0)
    square = picture(40, 40)
    expected = v2.Resize(16, antialias=True)(square)
    assert torch.equal(drawn(build_train_transform(whole.data), square, 0), expected)


def test_hflip_probability_and_off():
    assert not any(
        isinstance(t, v2.RandomHorizontalFlip)
        for t in build_train_transform(Config(hflip=0.0).data).transforms
    )
    always = Config(image_size=16, crop_scale=(1.0, 1.0), crop_ratio=(1.0, 1.0), hflip=1.0)
    square = picture(16, 16)
    assert torch.equal(drawn(build_train_transform(always.data), square, 0), square.flip(-1))


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("ra", v2.RandAugment),
        ("ta_wide", v2.TrivialAugmentWide),
        ("augmix", v2.AugMix),
        ("imagenet", v2.AutoAugment),
    ],
)
def test_auto_augment_policies_run_on_uint8(name, kind):
    config = Config(image_size=24, auto_augment=name, ra_magnitude=15, interpolation="nearest")
    transform = build_train_transform(config.data)
    policy = transform.transforms[-1]
    assert isinstance(policy, kind) and policy.interpolation == v2.InterpolationMode.NEAREST
    if name == "ra":
        assert policy.magnitude == 15
    for seed in range(4):
        out = drawn(transform, picture(seed=seed), seed)
        assert out.dtype == torch.uint8 and out.shape == (3, 24, 24)


def test_random_erase_fills_a_rectangle_with_the_mean_colour_on_uint8():
    config = Config(image_size=32, random_erase=1.0, hflip=0.0)
    erase = build_train_transform(config.data).transforms[-1]
    assert isinstance(erase, v2.RandomErasing) and erase.p == 1.0
    image = torch.zeros(3, 32, 32, dtype=torch.uint8)
    out = drawn(erase, image, 0)
    changed = (out != image).any(0)
    assert out.dtype == torch.uint8 and changed.any()
    assert torch.equal(out[:, changed].unique(dim=1), torch.tensor([MEAN_UINT8]).T)
    assert not any(
        isinstance(t, v2.RandomErasing) for t in build_train_transform(Config().data).transforms
    )


def test_random_erase_fills_with_the_mean_the_run_normalises_by():
    config = Config(image_size=32, random_erase=1.0, hflip=0.0, mean=(0.5, 0.25, 1.0))
    erase = build_train_transform(config.data).transforms[-1]
    out = drawn(erase, torch.zeros(3, 32, 32, dtype=torch.uint8), 0)
    changed = (out != 0).any(0)
    assert changed.any()
    assert torch.equal(out[:, changed].unique(dim=1), torch.tensor([[128, 64, 255]]).T)


def test_val_resize_and_crop():
    config = Config(image_size=176, val_resize=232, val_crop=224, interpolation="bicubic")
    assert val_sizes(config.data) == (232, 224)
    resize, crop = build_val_transform(config.data).transforms
    assert resize.size == [232] and crop.size == (224, 224)
    assert resize.interpolation == v2.InterpolationMode.BICUBIC
    assert build_val_transform(config.data)(picture(250, 300)).shape == (3, 224, 224)
    assert val_sizes(Config(image_size=32, val_crop=40).data) == (46, 40)


class Pictures(Dataset):
    def __init__(self, transform):
        self.transform = transform

    def __len__(self):
        return 4

    def __getitem__(self, index):
        return self.transform(picture(seed=index)), index


def test_the_full_augmentation_repeats_for_the_same_sample_seed():
    config = Config(image_size=24, auto_augment="ta_wide", random_erase=0.5)
    samples = SeededSamples(Pictures(build_train_transform(config.data)))
    first, again = samples[1, 1234][0], samples[1, 1234][0]
    assert torch.equal(first, again)
    assert any(not torch.equal(first, samples[1, seed][0]) for seed in range(5))


def test_the_loaders_build_their_transforms_from_the_config(tiny_data):
    config = Config(
        data=str(tiny_data),
        batch_size=4,
        workers=0,
        image_size=16,
        crop_scale=(0.6, 1.0),
        hflip=0.0,
        val_resize=20,
        val_crop=18,
    )
    data = build_data(config, ONE, open_source(config), seed=0)
    train = data.train_loader.dataset.dataset.transform.transforms
    assert len(train) == 1 and train[0].scale == (0.6, 1.0)
    images, _ = next(iter(data.val_loader))
    assert images.shape == (4, 3, 18, 18)
