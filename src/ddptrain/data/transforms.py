"""Train and val transforms on uint8 tensors (transforms v2), and the normalisation constants.

`build_train_transform(config.data)` and `build_val_transform(config.data)` make the run's
transforms from the augmentation flags; with the defaults they are the classic presets
`train_transform` and `val_transform`, draw for draw. They run in the loader workers, on uint8
images, under each sample's own seed (data/sampler.py `SeededSamples`), so augmentation stays
the same for a sample at any world size, worker count, or resume point. Normalisation comes
later, on the device (`Precision.inputs`); batch-level mixing (mixup, cutmix) after it, in
train/loss.py.
"""

from torchvision.transforms import v2

from ddptrain.config import VAL_CROP_RATIO, DataSettings

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
# Random erasing on uint8 images fills with the mean colour, which normalises to about 0:
# what torchvision's references erase with, on float images after normalisation.
MEAN_UINT8 = tuple(round(255 * m) for m in MEAN)


def normalization(data: DataSettings) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(mean, std) the inputs are normalised by: --mean and --std, else ImageNet's."""
    return data.mean or MEAN, data.std or STD


def mean_uint8(data: DataSettings) -> tuple[int, ...]:
    """The run's mean colour as uint8, what random erasing fills with (MEAN_UINT8 by default)."""
    return tuple(round(255 * m) for m in normalization(data)[0])


INTERPOLATION = {
    "bilinear": v2.InterpolationMode.BILINEAR,
    "bicubic": v2.InterpolationMode.BICUBIC,
    "nearest": v2.InterpolationMode.NEAREST,
}


def train_transform(size: int) -> v2.Compose:
    """The classic preset: uint8 (3, H, W) -> uint8 (3, size, size), a random crop and flip."""
    return v2.Compose([v2.RandomResizedCrop(size, antialias=True), v2.RandomHorizontalFlip()])


def val_transform(size: int) -> v2.Compose:
    """The classic preset: uint8 (3, H, W) -> uint8 (3, size, size), the centre at ImageNet's
    0.875 crop ratio."""
    return v2.Compose([v2.Resize(round(size / 0.875), antialias=True), v2.CenterCrop(size)])


def build_train_transform(data: DataSettings) -> v2.Compose:
    """uint8 (3, H, W) -> uint8 (3, S, S), S = --image-size: a random resized crop, then the
    flip, the auto-augment policy and random erasing the flags ask for, in torchvision's
    references' order."""
    interpolation = INTERPOLATION[data.interpolation]
    steps = [
        v2.RandomResizedCrop(
            data.image_size,
            scale=data.crop_scale,
            ratio=data.crop_ratio,
            interpolation=interpolation,
            antialias=True,
        )
    ]
    if data.hflip > 0:
        steps.append(v2.RandomHorizontalFlip(data.hflip))
    policy = _auto_augment(data.auto_augment, data.ra_magnitude, interpolation)
    if policy is not None:
        steps.append(policy)
    if data.random_erase > 0:
        steps.append(v2.RandomErasing(data.random_erase, value=mean_uint8(data)))
    return v2.Compose(steps)


def val_sizes(data: DataSettings) -> tuple[int, int]:
    """(resize, crop) of validation images: --val-resize and --val-crop, by default
    round(crop / 0.875) and --image-size."""
    crop = data.eval_crop
    return data.val_resize or round(crop / VAL_CROP_RATIO), crop


def build_val_transform(data: DataSettings) -> v2.Compose:
    """uint8 (3, H, W) -> uint8 (3, C, C), C = --val-crop: resize the short side, crop the
    centre."""
    resize, crop = val_sizes(data)
    interpolation = INTERPOLATION[data.interpolation]
    return v2.Compose(
        [v2.Resize(resize, interpolation=interpolation, antialias=True), v2.CenterCrop(crop)]
    )


def _auto_augment(name: str, magnitude: int, interpolation) -> v2.Transform | None:
    if name == "ra":
        return v2.RandAugment(magnitude=magnitude, interpolation=interpolation)
    if name == "ta_wide":
        return v2.TrivialAugmentWide(interpolation=interpolation)
    if name == "augmix":
        return v2.AugMix(interpolation=interpolation)
    if name == "imagenet":
        return v2.AutoAugment(v2.AutoAugmentPolicy.IMAGENET, interpolation=interpolation)
    return None
