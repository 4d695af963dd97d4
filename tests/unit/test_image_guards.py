"""The decompression-bomb guard holds for every format a decoder reads: HEIC and AVIF have their
size read from their own header before anything decodes them, a file with several frames or
images gives its first, and a file larger than an image of the limit can be is refused unread.

images/one.heic (one 64 x 48 image, coded as 64 x 64) and images/three.heic (three: red, then
green twice) were written with pillow-heif 1.9.0 (libheif), which ddptrain does not depend on:
`Image.new("RGB", (64, 48), (200, 10, 10)).save("one.heic")`, and the same with `save_all=True,
append_images=[green, green]`."""

import io
import os
import struct
from pathlib import Path

import pytest
import torch
from PIL import Image, features

from ddptrain.data import folder, heif
from ddptrain.errors import UserError

IMAGES = Path(__file__).parent / "images"
ONE, THREE = (IMAGES / "one.heic").read_bytes(), (IMAGES / "three.heic").read_bytes()


def declaring(data: bytes, width: int, height: int) -> bytes:
    """data with its first ispe property saying width x height."""
    at = data.index(b"ispe") + 8  # after its type, version and flags
    return data[:at] + width.to_bytes(4, "big") + height.to_bytes(4, "big") + data[at + 8 :]


def libheif() -> bool:
    try:
        from torchcodec.decoders import decode_heic

        decode_heic(ONE)
    except (ImportError, OSError, RuntimeError):
        return False
    return True


def test_a_heic_is_bounded_by_the_size_its_header_declares():
    assert folder.decode_problem(ONE, max_pixels=1000) == (
        "its header declares 64 x 64 = 4,096 pixels, more than --max-image-pixels 1,000 "
        "(a decompression bomb, or raise the limit)"
    )


def test_a_heic_bomb_is_refused_before_anything_decodes_it(monkeypatch):
    decoded = []
    monkeypatch.setattr(folder, "decode_image", lambda *a, **k: decoded.append(a))
    bomb = declaring(ONE, 60_000, 60_000)
    with pytest.raises(
        UserError, match=r"x.jpg: its header declares 60000 x 60000 = 3,600,000,000"
    ):
        folder.decode_rgb(bomb, "x.jpg")  # a HEIC by any name
    assert decoded == []


def test_a_heic_whose_header_gives_no_size_is_refused():
    cut = ONE[: ONE.index(b"ispe") - 100]
    assert folder.decode_problem(cut).startswith("a HEIF file (HEIC, AVIF) with a bad header: ")
    assert heif.is_heif(cut)


def box(kind: bytes, content: bytes, full: bool = False) -> bytes:
    """An ISO BMFF box; `full`: with a version and flags (0) first."""
    content = b"\0\0\0\0" + content if full else content
    return struct.pack(">I4s", 8 + len(content), kind) + content


def test_every_ipma_box_ties_its_sizes_as_libheif_reads_them():
    ispe = [box(b"ispe", struct.pack(">II", *size), full=True) for size in ((64, 64), (10**5,) * 2)]
    # item 1 to property 1, item 2 to property 2, each in an ipma box of its own
    ipma = [box(b"ipma", struct.pack(">IHBB", 1, i, 1, i), full=True) for i in (1, 2)]
    iprp = box(b"iprp", box(b"ipco", b"".join(ispe)) + b"".join(ipma))
    data = box(b"ftyp", b"heic\0\0\0\0mif1heic") + box(b"meta", iprp, full=True)
    assert heif.image_sizes(data) == [(64, 64), (10**5, 10**5)]
    assert "= 10,000,004,096 pixels, more than" in folder.decode_problem(data)


def test_the_images_of_a_multi_image_heic_are_bounded_together():
    assert heif.image_sizes(THREE) == [(64, 64)] * 3
    assert folder.decode_problem(THREE, max_pixels=3 * 4096 - 1) == (
        "its header declares 3 coded images (a grid's tiles each count) of up to 64 x 64, in "
        "all = 12,288 pixels, more than "
        "--max-image-pixels 12,287 (a decompression bomb, or raise the limit)"
    )


@pytest.mark.skipif(not libheif(), reason="TorchCodec finds no libheif to decode HEIC with")
def test_a_multi_image_heic_gives_its_first_image():
    assert folder.decode_problem(ONE, max_pixels=64 * 64) is None
    image = folder.decode_rgb(THREE, "three.heic")
    assert image.shape == (3, 48, 64)
    red, green, _ = image.float().mean(dim=(1, 2)).tolist()
    assert red > 150 and green < 60  # the first image is red, the others green


@pytest.mark.skipif(not features.check("avif"), reason="this Pillow reads no AVIF")
def test_an_animated_avif_gives_its_first_frame_as_check_says():
    frames = [Image.new("RGB", (16, 8), colour) for colour in ((250, 0, 0), (0, 250, 0))]
    out = io.BytesIO()
    frames[0].save(out, "AVIF", save_all=True, append_images=frames[1:], quality=100)
    image = folder.decode_rgb(out.getvalue(), "anim.avif")
    assert image.shape == (3, 8, 16)
    assert image[0].float().mean() > 200 and image[1].float().mean() < 50
    assert folder.decode_problem(out.getvalue()) is None


def test_a_file_larger_than_an_image_of_the_limit_is_refused_unread(tmp_path):
    sparse = tmp_path / "x.png"
    with open(sparse, "wb") as f:  # 1 GB that takes no room
        f.write(b"\x89PNG\r\n\x1a\n")
        f.truncate(10**9)
    assert os.stat(sparse).st_blocks < 100
    with pytest.raises(UserError, match=r"x.png: it has 1,000,000,000 bytes, more than an image"):
        folder.load_rgb(str(sparse))
    small_limit = folder.image_problem(str(sparse), max_pixels=1000)
    assert small_limit == (
        "it has 1,000,000,000 bytes, more than an image of --max-image-pixels 1,000 takes "
        "(1,056,576: 8 bytes a pixel and 1 MiB)"
    )


def test_encoded_bytes_larger_than_an_image_of_the_limit_are_refused():
    big = io.BytesIO()
    Image.new("RGB", (20, 20)).save(big, "PNG", pnginfo=_text(2 << 20))
    assert folder.decode_problem(big.getvalue(), max_pixels=400).startswith("it has 2,0")
    assert folder.decode_rgb(big.getvalue(), "ok.png").shape == (3, 20, 20)


def _text(size: int):
    from PIL import PngImagePlugin

    info = PngImagePlugin.PngInfo()
    info.add_text("comment", "x" * size)
    return info


def test_an_image_that_decodes_to_more_than_one_frame_is_refused(monkeypatch):
    # frames its header did not declare: as a decoder giving more than it was asked for
    monkeypatch.setattr(folder, "decode_image", lambda *a, **k: torch.zeros(2, 3, 4, 5))
    encoded = io.BytesIO()
    Image.new("RGB", (5, 4)).save(encoded, "PNG")
    with pytest.raises(UserError) as raised:
        folder.decode_rgb(encoded.getvalue(), "x.png")
    assert str(raised.value).startswith(
        "cannot read image x.png: it decodes to (2, 3, 4, 5), not one RGB image (3, H, W)"
    )
