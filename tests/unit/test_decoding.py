"""TorchCodec decodes the same pixels as torchvision.io did (JPEG, PNG, WebP, grayscale, 16-bit),
turns EXIF-rotated photos upright (a choice: torchvision.io and the classic example's PIL loader
do not), converts CMYK as PIL does, and raises no deprecation warning."""

import io
import warnings

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps
from torchvision.transforms.v2 import functional as F

from ddptrain.data.folder import decode_rgb
from ddptrain.data.shrink import shrink

RNG = np.random.default_rng(0)
PHOTO = Image.fromarray(RNG.integers(0, 255, (20, 30, 3), dtype=np.uint8))
ORIENTATION = 0x0112  # the EXIF tag


def encoded(image: Image.Image, fmt: str, **options) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt, **options)
    return out.getvalue()


def torchvision_io(data: bytes) -> torch.Tensor:
    """What ddptrain decoded before TorchCodec (torchvision.io, deprecated since 0.29)."""
    from torchvision.io import ImageReadMode, decode_image

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        image = decode_image(
            torch.frombuffer(bytearray(data), dtype=torch.uint8), ImageReadMode.RGB
        )
    return F.to_dtype(image, torch.uint8, scale=True)


def pil_rgb(data: bytes, upright: bool = True) -> torch.Tensor:
    image = Image.open(io.BytesIO(data))
    if upright:
        image = ImageOps.exif_transpose(image)
    return F.pil_to_tensor(image.convert("RGB"))


def with_orientation(orientation: int) -> Image.Exif:
    exif = PHOTO.getexif()
    exif[ORIENTATION] = orientation
    return exif


SAME_AS_BEFORE = {
    "jpeg": encoded(PHOTO, "JPEG", quality=90),
    "grayscale jpeg": encoded(PHOTO.convert("L"), "JPEG"),
    "png": encoded(PHOTO, "PNG"),
    "grayscale png": encoded(PHOTO.convert("L"), "PNG"),
    "rgba png": encoded(PHOTO.convert("RGBA"), "PNG"),
    "palette png": encoded(PHOTO.convert("P"), "PNG"),
    "16-bit png": encoded(
        Image.fromarray(RNG.integers(0, 65535, (20, 30), dtype=np.uint16)), "PNG"
    ),
    "webp": encoded(PHOTO, "WEBP", quality=90),
    "lossless webp": encoded(PHOTO, "WEBP", lossless=True),
}


@pytest.mark.parametrize("kind", SAME_AS_BEFORE)
def test_the_same_pixels_as_torchvision_io(kind):
    data = SAME_AS_BEFORE[kind]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torchvision.io's DeprecationWarning among them
        image = decode_rgb(data, kind)
    assert image.dtype == torch.uint8 and image.shape[0] == 3
    assert torch.equal(image, torchvision_io(data))


@pytest.mark.parametrize("orientation", range(2, 9))
def test_exif_rotated_photos_are_turned_upright(orientation):
    data = encoded(PHOTO, "JPEG", exif=with_orientation(orientation).tobytes())
    image = decode_rgb(data, "rotated.jpg")
    assert torch.equal(image, pil_rgb(data))  # as PIL's exif_transpose turns it
    before = torchvision_io(data)
    assert image.shape != before.shape or not torch.equal(image, before)
    if orientation >= 5:  # a quarter turn: width and height swap
        assert image.shape == (3, 30, 20)


def test_cmyk_converts_as_pil_does():
    data = encoded(PHOTO.convert("CMYK"), "JPEG", quality=95)
    assert torch.equal(decode_rgb(data, "cmyk.jpg"), pil_rgb(data))


def test_an_animated_webp_gives_its_first_frame():
    frames = [Image.new("RGB", (5, 4), (v, v, v)) for v in (10, 200)]
    data = encoded(frames[0], "WEBP", save_all=True, append_images=frames[1:], lossless=True)
    assert torch.equal(decode_rgb(data, "anim.webp"), torch.full((3, 4, 5), 10, dtype=torch.uint8))


def test_a_shrunk_rotated_photo_is_stored_upright():
    big = Image.fromarray(RNG.integers(0, 255, (60, 90, 3), dtype=np.uint8))
    exif = big.getexif()
    exif[ORIENTATION] = 6
    data = encoded(big, "JPEG", exif=exif.tobytes())
    small, ext, why = shrink(data, "jpg", max_side=45, quality=90)
    assert why is None and ext == "jpg"
    # what training decodes of the shrunk file has the upright shape of the original's
    assert decode_rgb(data, "big").shape == (3, 90, 60)
    assert decode_rgb(small, "small").shape == (3, 45, 30)
