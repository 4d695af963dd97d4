"""Transform presets on uint8 tensors (transforms v2), and the normalisation constants."""

from torchvision.transforms import v2

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def train_transform(size: int) -> v2.Compose:
    """uint8 (3, H, W) -> uint8 (3, size, size): a random crop and flip."""
    return v2.Compose([v2.RandomResizedCrop(size, antialias=True), v2.RandomHorizontalFlip()])


def val_transform(size: int) -> v2.Compose:
    """uint8 (3, H, W) -> uint8 (3, size, size): the centre at ImageNet's 0.875 crop ratio."""
    return v2.Compose([v2.Resize(round(size / 0.875), antialias=True), v2.CenterCrop(size)])
