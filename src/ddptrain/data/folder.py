"""Image folders: class discovery, checks, and decoding files into uint8 RGB tensors."""

import hashlib
import io
import os
from pathlib import Path

import torch
from PIL import Image
from torchvision import datasets
from torchvision.io import ImageReadMode, decode_image
from torchvision.transforms.v2 import functional as F

from ddptrain.errors import UserError


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


def image_folder(root: Path, transform) -> ImageFolder:
    if not root.is_dir():
        raise UserError(f"data directory {root} does not exist (DATA must hold train/ and val/)")
    try:
        return ImageFolder(str(root), transform=transform, loader=load_rgb)
    except FileNotFoundError as err:  # no class folders, or a class folder with no images
        raise UserError(f"{root}: {err}") from None


def check_same_classes(train: ImageFolder, val: ImageFolder) -> None:
    if train.classes != val.classes:
        only_train = sorted(set(train.classes) - set(val.classes))
        only_val = sorted(set(val.classes) - set(train.classes))
        raise UserError(
            f"class folders of {train.root} and {val.root} differ: only in train: "
            f"{only_train or 'none'}; only in val: {only_val or 'none'}"
        )


def facts(dataset: ImageFolder) -> dict:
    """The image count and a digest of the sorted file list (paths relative to the split's root,
    with labels): what a checkpoint records, so that resuming on other data is noticed."""
    prefix = os.path.join(dataset.root, "")
    digest = hashlib.sha256()
    for path, label in sorted(dataset.samples):
        relative = path[len(prefix) :] if path.startswith(prefix) else path
        digest.update(f"{relative}\t{label}\n".encode())
    return {"images": len(dataset.samples), "digest": digest.hexdigest()}
