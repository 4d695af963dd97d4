"""The uint8 pipeline (TorchCodec decode, v2 on uint8, normalise on the device) keeps the
semantics of the PIL + ToTensor + Normalize pipeline it replaces."""

import shutil

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision import transforms as T

from ddptrain.config import Config
from ddptrain.data import folder
from ddptrain.data.folder import ImageFolder, load_rgb
from ddptrain.data.loaders import build_data
from ddptrain.data.sampler import SeededSamples
from ddptrain.data.sources import open_source
from ddptrain.data.transforms import MEAN, STD, train_transform, val_transform
from ddptrain.distributed.env import DistEnv
from ddptrain.errors import UserError, one_line
from ddptrain.model.precision import Precision

CPU = torch.device("cpu")
ONE = DistEnv(rank=0, world_size=1, local_rank=0, local_world_size=1, device=CPU)
ONE_LEVEL = 1 / (255 * min(STD))  # one uint8 step, in normalised units


@pytest.fixture(scope="module")
def photo(tmp_path_factory):
    """A fixed 120x90 JPEG with gradients and texture, so resampling differences would show."""
    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:90, 0:120]
    pixels = np.stack([x * 2, y * 2.5, (x + y) % 64 * 4], -1) + rng.integers(0, 40, (90, 120, 3))
    path = tmp_path_factory.mktemp("img") / "photo.jpg"
    Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(path, quality=90)
    return str(path)


def classic(*geometry) -> T.Compose:
    return T.Compose([*geometry, T.ToTensor(), T.Normalize(MEAN, STD)])


def normalised(image: torch.Tensor) -> torch.Tensor:
    return Precision("cpu").inputs(image[None], CPU)[0]


def difference(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """|new - old|, checked to be at most one uint8 level anywhere: both resample uint8 pixels
    with antialiased bilinear filters that round alike but for rare ties."""
    assert new.shape == old.shape and new.dtype == torch.float32
    diff = (new - old).abs()
    assert diff.max() <= ONE_LEVEL + 1e-6 and diff.mean() < 1e-3
    return diff


def test_val_transform_matches_the_classic_pipeline(photo):
    pil = Image.open(photo).convert("RGB")
    for size in (32, 64, 80):
        image = val_transform(size)(load_rgb(photo))
        assert image.dtype == torch.uint8 and image.shape == (3, size, size)
        old = classic(T.Resize(round(size / 0.875)), T.CenterCrop(size))(pil)
        assert (difference(normalised(image), old) > 1e-2).float().mean() < 0.01


def test_train_transform_takes_the_same_crop_and_flip_for_the_same_random_state(photo):
    pil = Image.open(photo).convert("RGB")
    for seed in range(6):
        torch.manual_seed(seed)
        old = classic(T.RandomResizedCrop(48), T.RandomHorizontalFlip())(pil)
        torch.manual_seed(seed)
        image = train_transform(48)(load_rgb(photo))
        assert image.dtype == torch.uint8 and image.shape == (3, 48, 48)
        difference(normalised(image), old)  # another crop or flip would differ everywhere


def test_seeded_samples_repeat_their_crop(tmp_path, photo):
    (tmp_path / "a").mkdir()
    Image.open(photo).save(tmp_path / "a" / "x.jpg")
    folder = ImageFolder(str(tmp_path), train_transform(32), loader=load_rgb)
    samples = SeededSamples(folder)
    first, again, other = samples[0, 7][0], samples[0, 7][0], samples[0, 8][0]
    assert torch.equal(first, again) and not torch.equal(first, other)


def test_loader_yields_uint8_and_inputs_normalise_in_the_runs_layout(tiny_data):
    config = Config(data=str(tiny_data), batch_size=4, workers=0, image_size=16)
    images, _ = next(iter(build_data(config, ONE, open_source(config), seed=0).train_loader))
    assert images.dtype == torch.uint8 and images.shape == (4, 3, 16, 16)
    for channels_last in (False, True):
        x = Precision("cpu", channels_last=channels_last).inputs(images, CPU)
        assert x.dtype == torch.float32 and x.shape == (4, 3, 16, 16)
        layout = torch.channels_last if channels_last else torch.contiguous_format
        assert x.is_contiguous(memory_format=layout)
        mean = torch.tensor(MEAN).view(1, 3, 1, 1)
        std = torch.tensor(STD).view(1, 3, 1, 1)
        assert torch.allclose(x, (images.float() / 255 - mean) / std, atol=1e-5)


@pytest.mark.parametrize(
    ("mode", "suffix"),
    [("L", "jpg"), ("L", "png"), ("RGB", "png"), ("RGBA", "png"), ("P", "png"), ("RGB", "bmp")],
)
def test_any_image_becomes_rgb_as_pil_converts_it(tmp_path, mode, suffix):
    rng = np.random.default_rng(1)
    pixels = rng.integers(0, 255, (20, 30, 3), dtype=np.uint8)
    path = tmp_path / f"image.{suffix}"
    Image.fromarray(pixels).convert(mode).save(path)
    image = load_rgb(str(path))
    expected = torch.from_numpy(np.array(Image.open(path).convert("RGB"))).permute(2, 0, 1)
    assert image.dtype == torch.uint8 and torch.equal(image, expected)


def test_16_bit_png_and_gif_frames(tmp_path, monkeypatch):
    deep = tmp_path / "deep.png"
    Image.fromarray(np.full((4, 5), 65535, dtype=np.uint16)).save(deep)
    assert torch.equal(load_rgb(str(deep)), torch.full((3, 4, 5), 255, dtype=torch.uint8))
    frames = [Image.new("RGB", (5, 4), (v, v, v)) for v in (10, 200)]
    gif = tmp_path / "anim.gif"
    frames[0].save(gif, save_all=True, append_images=frames[1:])
    # the first frame alone is decoded: TorchCodec's decoder would make every frame, more
    # pixels than the size check (of one frame) bounds
    monkeypatch.setattr(folder, "decode_image", lambda *a, **k: pytest.fail("every frame"))
    assert torch.equal(load_rgb(str(gif)), torch.full((3, 4, 5), 10, dtype=torch.uint8))


def test_an_undecodable_image_in_a_worker_is_named(tiny_data, tmp_path):
    root = tmp_path / "data"
    shutil.copytree(tiny_data, root)
    bad = root / "val" / "arrow" / "00000.png"
    bad.write_bytes(bad.read_bytes()[:40])  # truncated
    config = Config(data=str(root), batch_size=4, workers=1, image_size=16)
    loaders = build_data(config, ONE, open_source(config), seed=0)
    with pytest.raises(UserError) as caught:
        for _ in loaders.val_loader:
            pass
    assert one_line(caught.value).startswith(f"cannot read image {bad}: ")
    # Found after a whole epoch here: the way to find them all first, or to go on without them.
    assert one_line(caught.value).endswith(
        "(`ddptrain check DATA` lists every bad image; --bad-images skip trains without them)"
    )


def test_an_empty_file_is_named(tmp_path):
    empty = tmp_path / "empty.jpg"
    empty.write_bytes(b"")
    with pytest.raises(UserError, match="empty.jpg"):
        load_rgb(str(empty))


def test_dummy_data_takes_the_same_uint8_path():
    config = Config(dummy=True, batch_size=2, workers=0, image_size=16)
    loaders = build_data(config, ONE, open_source(config), seed=0)
    images, target = next(iter(loaders.train_loader))
    assert images.dtype == torch.uint8 and images.shape == (2, 3, 16, 16)
    images, _ = next(iter(loaders.val_loader))
    assert images.dtype == torch.uint8 and images.shape == (2, 3, 16, 16)
