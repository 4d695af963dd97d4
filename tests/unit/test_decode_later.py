"""--decode-device cuda's path, run on the CPU device: the workers leave plain JPEGs encoded,
the training process decodes each batch and transforms each image under its sample's seed, and
the batches equal the workers' own, augmentation and all (the GPU's kernels may resample
otherwise; the parameters drawn are the same)."""

import io
import warnings

import numpy as np
import pytest
import torch
from PIL import Image

from ddptrain.config import Config
from ddptrain.data import decode
from ddptrain.data.folder import Jpeg, decode_rgb, load_rgb
from ddptrain.data.loaders import build_data
from ddptrain.data.sources import open_source
from ddptrain.distributed.env import DistEnv
from ddptrain.errors import UserError

CPU = torch.device("cpu")
ONE = DistEnv(rank=0, world_size=1, local_rank=0, local_world_size=1, device=CPU)


def photo(rng, width=40, height=30) -> Image.Image:
    return Image.fromarray(rng.integers(0, 255, (height, width, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def jpeg_data(tmp_path_factory):
    """2 classes of JPEGs, with a PNG and an EXIF-rotated JPEG among them (decoded in the
    workers, file by file)."""
    root = tmp_path_factory.mktemp("jpegs")
    rng = np.random.default_rng(0)
    for split, count in (("train", 8), ("val", 3)):
        for name in ("a", "b"):
            (root / split / name).mkdir(parents=True)
            for i in range(count):
                photo(rng).save(root / split / name / f"{i}.jpg", quality=90)
    photo(rng).save(root / "train" / "a" / "x.png")
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: a quarter turn
    photo(rng).save(root / "train" / "b" / "x.jpg", exif=exif.tobytes())
    photo(rng).save(root / "val" / "b" / "x.png")
    return root


def batches(root, decode_device: str, workers: int) -> tuple[list, list]:
    config = Config(
        data=str(root), batch_size=5, workers=workers, image_size=16, auto_augment="ra",
        random_erase=0.5, decode_device=decode_device,
    )  # fmt: skip
    data = build_data(config, ONE, open_source(config), seed=3)
    data.train_sampler.set_epoch(1)
    return list(data.train_loader), list(data.val_loader)


def test_decoded_later_the_batches_equal_the_workers(jpeg_data):
    train, val = batches(jpeg_data, "cpu", workers=0)
    later_train, later_val = batches(jpeg_data, "cuda", workers=1)
    assert len(later_train) == len(train) == 3 and len(later_val) == len(val) == 2
    for (images, target), (later, later_target) in zip(
        train + val, later_train + later_val, strict=True
    ):
        assert later.dtype == torch.uint8 and later.shape == images.shape
        assert torch.equal(later, images) and torch.equal(later_target, target)


def test_decoded_later_the_process_counts_its_decoding(jpeg_data):
    config = Config(data=str(jpeg_data), batch_size=5, workers=0, decode_device="cuda")
    loader = build_data(config, ONE, open_source(config), seed=0).train_loader
    assert sum(len(images) for images, _ in loader) == 15
    # at most the PNG and the rotated JPEG were decoded in the workers
    assert 13 <= loader.jpegs <= 15 and loader.cpu_seconds > 0


def encoded(image: Image.Image, fmt: str, **options) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt, **options)
    return out.getvalue()


def test_only_plain_jpegs_are_left_encoded(tmp_path):
    rng = np.random.default_rng(1)
    plain = encoded(photo(rng), "JPEG")
    left = decode_rgb(plain, "plain.jpg", jpeg_later=True)
    assert isinstance(left, Jpeg) and left.data == plain and left.name == "plain.jpg"
    gray = encoded(photo(rng).convert("L"), "JPEG")
    assert isinstance(decode_rgb(gray, "gray.jpg", jpeg_later=True), Jpeg)
    exif = Image.Exif()
    exif[0x0112] = 3
    others = {
        "rotated.jpg": encoded(photo(rng), "JPEG", exif=exif.tobytes()),
        "cmyk.jpg": encoded(photo(rng).convert("CMYK"), "JPEG"),
        "x.png": encoded(photo(rng), "PNG"),
    }
    for name, data in others.items():
        image = decode_rgb(data, name, jpeg_later=True)
        assert isinstance(image, torch.Tensor) and torch.equal(image, decode_rgb(data, name))
    # the size check holds for the bytes left encoded too
    path = tmp_path / "big.jpg"
    path.write_bytes(plain)
    with pytest.raises(Exception, match="decompression bomb"):
        load_rgb(str(path), max_pixels=100, jpeg_later=True)


def test_torchvision_decodes_the_batch_where_torchcodec_is_missing():
    rng = np.random.default_rng(2)
    data = [encoded(photo(rng), "JPEG"), encoded(photo(rng, 24, 20).convert("L"), "JPEG")]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # its DeprecationWarning is silenced there alone
        by_torchvision = decode.torchvision_decode_jpegs(data, CPU)
    for image, by_torchcodec in zip(by_torchvision, decode.decode_jpegs(data, CPU), strict=True):
        assert image.shape[0] == 3 and torch.equal(image, by_torchcodec)


def test_a_jpeg_the_batch_decoder_refuses_is_named(tmp_path):
    rng = np.random.default_rng(3)
    good = encoded(photo(rng), "JPEG")
    images = [Jpeg(good, "good.jpg"), Jpeg(good[: len(good) // 3], "cut.jpg")]
    batches = decode.DecodedBatches([], lambda image: image, CPU)
    with pytest.raises(UserError, match="cannot read image cut.jpg"):
        batches.decode(images)
