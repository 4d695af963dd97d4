"""Image folders: class discovery, checks, and decoding files into uint8 RGB tensors."""

import functools
import hashlib
import io
import os
import stat
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from PIL import ExifTags, Image, ImageOps, UnidentifiedImageError
from torchvision import datasets
from torchvision.datasets.folder import IMG_EXTENSIONS, has_file_allowed_extension
from torchvision.transforms.v2 import functional as F

from ddptrain.config import MAX_IMAGE_PIXELS
from ddptrain.data import heif
from ddptrain.data.strings import Strings
from ddptrain.errors import UserError

try:  # a GPU machine's own torch may have no TorchCodec built for it: PIL decodes then
    from torchcodec.decoders import decode_image
except (ImportError, OSError, RuntimeError):
    decode_image = None

# --max-image-pixels is checked on every file's header before any decoder runs (_check_header).
# PIL's own check would cover only the files PIL decodes, and refuse at twice its limit
# whatever the flag says.
Image.MAX_IMAGE_PIXELS = None


class _Unreadable(Exception):
    """Why a file is not a usable image. Raised and caught in this module only: across a
    DataLoader worker's pipe only UserError keeps its type."""


class Jpeg(NamedTuple):
    """A JPEG left encoded for the training process to decode on its device
    (--decode-device cuda, data/decode.py), with the augmentation seed of its sample."""

    data: bytes
    name: str  # in messages, as load_rgb and decode_rgb name it
    seed: int = 0


def load_rgb(
    path: str, max_pixels: int | None = MAX_IMAGE_PIXELS, jpeg_later: bool = False
) -> torch.Tensor | Jpeg:
    """An image file as a uint8 RGB tensor (3, H, W); names the file when it cannot be decoded,
    when its header declares more than max_pixels pixels (a decompression bomb), or when it is
    larger than such an image can be (max_file_bytes: refused unread).
    `jpeg_later`: a JPEG that needs no more than decoding to RGB (no EXIF turn, no CMYK) comes
    back as a Jpeg, its header checked.

    TorchCodec decodes JPEG, PNG, WebP, AVIF and HEIC straight into a tensor (the same
    libjpeg-turbo, libpng and libwebp pixels as PIL, without PIL's image object and
    conversions), and turns a photo upright by its EXIF orientation; GIF, animated or
    multi-frame files PIL reads, other formats (BMP, TIFF, PPM) and files TorchCodec refuses
    go through PIL, upright alike, whose error names what is wrong. A multi-image HEIC gives
    its first image, all of its images bounded by max_pixels together.
    """
    try:
        return _decode(_read(path, max_pixels), max_pixels, path if jpeg_later else None)
    except _Unreadable as err:
        raise _cannot_read(path, err) from None


def decode_rgb(
    encoded: bytes, name: str, max_pixels: int | None = MAX_IMAGE_PIXELS, jpeg_later: bool = False
) -> torch.Tensor | Jpeg:
    """Encoded image bytes (a table's cell) as load_rgb decodes a file's, with the same size
    check; `name` says which image in messages."""
    try:
        return _decode(encoded, max_pixels, name if jpeg_later else None)
    except _Unreadable as err:
        raise _cannot_read(name, err) from None


def _cannot_read(name: str, err: _Unreadable) -> UserError:
    # Found as the loader reaches it, a val image after a whole epoch: say how to find them
    # all before training, or train without them.
    return UserError(
        f"cannot read image {name}: {err} (`ddptrain check DATA` lists every bad image; "
        "--bad-images skip trains without them)"
    )


def image_problem(path: str, max_pixels: int | None = MAX_IMAGE_PIXELS) -> str | None:
    """Why load_rgb would refuse path, or None when it decodes."""
    try:
        _read_rgb(path, max_pixels)
    except _Unreadable as err:
        return str(err)
    return None


def decode_problem(encoded: bytes, max_pixels: int | None = MAX_IMAGE_PIXELS) -> str | None:
    """Why decode_rgb would refuse the bytes, or None when they decode."""
    try:
        _decode(encoded, max_pixels)
    except _Unreadable as err:
        return str(err)
    return None


def _read_rgb(path: str, max_pixels: int | None) -> torch.Tensor:
    return _decode(_read(path, max_pixels), max_pixels)


def max_file_bytes(max_pixels: int) -> int:
    """The largest file an image of max_pixels may be: 8 bytes a pixel (16-bit RGBA, raw) and
    1 MiB of metadata. A larger one is refused before it is read."""
    return 8 * max_pixels + (1 << 20)


def too_large(size: int, max_pixels: int | None) -> str | None:
    """Why an encoded image of `size` bytes is refused unread, or None."""
    if max_pixels is None or size <= max_file_bytes(max_pixels):
        return None
    return (
        f"it has {size:,} bytes, more than an image of --max-image-pixels {max_pixels:,} "
        f"takes ({max_file_bytes(max_pixels):,}: 8 bytes a pixel and 1 MiB)"
    )


def _read(path: str, max_pixels: int | None = None) -> bytes:
    try:
        found = os.stat(path)
        if not stat.S_ISREG(found.st_mode):  # a FIFO's read would wait forever
            raise _Unreadable("not a regular file")
        if why := too_large(found.st_size, max_pixels):
            raise _Unreadable(why)
        with open(path, "rb") as f:
            if max_pixels is None:
                return f.read()
            # Never more than the bound and a byte, even from a file that grew since its stat;
            # asked for its size first: a read of n bytes reserves n before it reads.
            limit = max_file_bytes(max_pixels) + 1
            encoded = f.read(min(found.st_size + 1, limit))
            if len(encoded) == found.st_size + 1 < limit:  # it grew since
                encoded += f.read(limit - len(encoded))
    except OSError as err:
        raise _Unreadable(err.strerror) from None
    if why := too_large(len(encoded), max_pixels):
        raise _Unreadable(why)
    return encoded


class _Header(NamedTuple):
    """What an image's header says, read before anything decodes it."""

    format: str  # PIL's name of it, or HEIF
    frames: int  # frames or images it holds
    plain_jpeg: bool  # a JPEG that decoding alone makes RGB (grayscale or colour, upright)


# What TorchCodec decodes, one frame of them (GIF always goes through PIL, as torchvision's
# decoders did); every other format PIL reads goes through PIL.
_TORCHCODEC = ("JPEG", "PNG", "WEBP", "AVIF", "HEIF")


def _decode(
    encoded: bytes, max_pixels: int | None, later_as: str | None = None
) -> torch.Tensor | Jpeg:
    """later_as: a plain JPEG comes back encoded, as a Jpeg of this name. Nothing decodes an
    image whose size its header did not give (_check_header)."""
    header = _check_header(encoded, max_pixels)
    if later_as is not None and header.plain_jpeg:
        return Jpeg(encoded, later_as)
    # Animated and multi-frame files PIL reads give their first frame through PIL: TorchCodec
    # decodes every frame, which the size check (of one frame) does not bound.
    pil_first = header.frames > 1 and header.format != "HEIF"
    if pil_first or header.format not in _TORCHCODEC or decode_image is None:
        return _one_frame(_decode_with_pil(encoded))
    try:
        # "auto": a 16-bit PNG's values, brought to 8 bits below as torchvision.io's were
        image = decode_image(encoded, mode="RGB", output_dtype="auto")
    except (RuntimeError, ValueError):  # a bad file, or libheif missing
        return _one_frame(_decode_with_pil(encoded))
    if image.ndim == 4 and header.frames > 1:  # a HEIF's images, bounded together: the first
        image = image[0]
    return _one_frame(image)


def _one_frame(image: torch.Tensor) -> torch.Tensor:
    """The decoded image as uint8 RGB (3, H, W); anything else (frames the header did not
    declare) is refused."""
    if image.ndim != 3 or image.shape[0] != 3:
        raise _Unreadable(f"it decodes to {tuple(image.shape)}, not one RGB image (3, H, W)")
    if image.dtype != torch.uint8:
        image = F.to_dtype(image, torch.uint8, scale=True)
    return image


def _check_header(encoded: bytes, max_pixels: int | None) -> _Header:
    """What the header says; refuses a decompression bomb by what its header declares, before
    a decoder allocates the pixels. PIL reads just the header here, a small fraction of a
    decode's cost; a HEIF file, which PIL does not read, has its own header read (heif.py)."""
    if why := too_large(len(encoded), max_pixels):
        raise _Unreadable(why)
    try:
        with Image.open(io.BytesIO(encoded)) as image:
            (width, height), frames = image.size, getattr(image, "n_frames", 1)
            plain_jpeg = (
                image.format == "JPEG"
                and image.mode in ("L", "RGB")
                and image.getexif().get(ExifTags.Base.Orientation, 1) == 1
            )
            header = _Header(image.format, frames, plain_jpeg)
            sizes = [(width, height)]
    except Exception:  # no header PIL knows (its errors vary)
        if not heif.is_heif(encoded):
            return _Header("", 1, False)  # no decoder will read it: PIL says why
        try:
            sizes = heif.image_sizes(encoded)
        except heif.Damaged as err:
            raise _Unreadable(f"a HEIF file (HEIC, AVIF) with a bad header: {err}") from None
        header = _Header("HEIF", len(sizes), False)
    pixels = sum(width * height for width, height in sizes)
    if max_pixels is not None and pixels > max_pixels:
        width, height = max(sizes, key=lambda size: size[0] * size[1])
        declared = f"{width} x {height}"
        if len(sizes) > 1:
            declared = (
                f"{len(sizes)} coded images (a grid's tiles each count) of up to {declared}, in all"
            )
        raise _Unreadable(
            f"its header declares {declared} = {pixels:,} pixels, more than "
            f"--max-image-pixels {max_pixels:,} (a decompression bomb, or raise the limit)"
        )
    return header


def _decode_with_pil(encoded: bytes) -> torch.Tensor:
    try:
        with Image.open(io.BytesIO(encoded)) as image:
            upright = ImageOps.exif_transpose(image)  # as TorchCodec turns a JPEG
            return F.pil_to_tensor(upright.convert("RGB"))
    except UnidentifiedImageError:  # whose message shows a BytesIO object
        raise _Unreadable("not an image in a format TorchCodec or PIL reads") from None
    except (OSError, SyntaxError, ValueError) as err:
        raise _Unreadable(str(err)) from None


# torchvision's list, and GIF, which the decoders read but the list leaves out
EXTENSIONS = (*IMG_EXTENSIONS, ".gif")


class Samples(Sequence[tuple[str, int]]):
    """(path, class index) pairs as torchvision's ImageFolder lists them, in a Strings of the
    paths and an array of the labels: what each loader worker gets of a split
    (data/strings.py)."""

    def __init__(self, pairs: Iterable[tuple[str, int]]):
        pairs = list(pairs)
        self.paths = Strings(path for path, _ in pairs)
        self.labels = np.array([label for _, label in pairs], dtype=np.int64)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        return self.paths[index], int(self.labels[index])

    def __eq__(self, other) -> bool:
        return list(self) == list(other)


class ImageFolder(datasets.ImageFolder):
    """torchvision's ImageFolder that skips hidden files and folders at any depth
    (.ipynb_checkpoints, .Trash, a thumbnail cache in a class folder, macOS's ._ files), takes
    GIFs too, and keeps its samples compact (Samples). `loose`: the image files that sit in the
    split's folder itself, in no class folder, which no class takes (their names, sorted)."""

    loose: list[str]
    max_pixels: int | None = MAX_IMAGE_PIXELS
    jpeg_later = False  # load_rgb's: --decode-device cuda (data/decode.py)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.samples = self.imgs = Samples(self.samples)

    @property
    def targets(self) -> list[int]:
        """Each sample's class index, in order."""
        return self.samples.labels.tolist()

    @targets.setter
    def targets(self, value) -> None:
        """torchvision's __init__ sets them from the samples: they stay the samples' labels."""
        assert list(value) == [label for _, label in self.samples], "set the samples instead"

    def __getitem__(self, index: int):
        path, target = self.samples[index]
        image = load_rgb(path, self.max_pixels, self.jpeg_later)
        if self.transform is not None:
            image = self.transform(image)
        return image, target

    def names(self) -> list[str]:
        """Each sample's name in its split (class/file), in order: what `ddptrain pack` records."""
        return relative_paths(self)

    def encoded(self, i: int) -> tuple[bytes, str]:
        """Sample i's file as it is, and its extension in lower case: what `ddptrain pack`
        stores (data/tables.py's rows give the same)."""
        path = self.samples[i][0]
        try:
            encoded = _read(path, self.max_pixels)
        except _Unreadable as err:
            raise UserError(f"cannot read {path}: {err}") from None
        return encoded, os.path.splitext(path)[1][1:].lower()

    def find_classes(self, directory: str) -> tuple[list[str], dict[str, int]]:
        entries = [e for e in os.scandir(directory) if not e.name.startswith(".")]
        self.loose = sorted(
            e.name
            for e in entries
            if not e.is_dir() and has_file_allowed_extension(e.name, EXTENSIONS)
        )
        for entry in entries:
            if entry.is_symlink():
                # A link that leads nowhere is no folder, so no class: a class on an unmounted
                # disk, in train and val alike, would leave the run one class short unsaid.
                try:
                    os.stat(entry.path)
                except OSError as err:
                    target = os.readlink(entry.path)
                    raise OSError(f"{entry.name} links to {target}: {err.strerror}") from None
        classes = sorted(e.name for e in entries if e.is_dir())
        if not classes:
            raise FileNotFoundError(f"no class folders in {directory}")
        return classes, {name: i for i, name in enumerate(classes)}

    @staticmethod
    def make_dataset(directory, class_to_idx, extensions=None, is_valid_file=None, **kwargs):
        """Each class folder's image files, walked as torchvision walks them (sorted, links
        followed), but a folder that cannot be read is an error: torchvision's walk passes over
        it in silence, leaving its images out of the run or calling its class empty."""
        prefix = os.path.join(directory, "")

        def is_image(path: str) -> bool:
            below = path[len(prefix) :]  # class/.../file, without relpath's cost per file
            hidden = below.startswith(".") or os.sep + "." in below
            return not hidden and has_file_allowed_extension(path, EXTENSIONS)

        # Each folder once: os.walk follows a link back up (`ln -s .. loop`) until the path is
        # too long, and a link into another class, listing images again or under the wrong
        # class.
        seen: dict[tuple[int, int], str] = {}

        def list_once(folder: str) -> None:
            found = os.stat(folder)
            where = found.st_dev, found.st_ino
            if where in seen:
                raise OSError(
                    f"{folder} is {seen[where]}, listed already (a link loop, or a second link "
                    "to one folder)"
                )
            seen[where] = folder

        class_dirs = {name: os.path.join(directory, name) for name in class_to_idx}
        for class_dir in class_dirs.values():
            list_once(class_dir)
        samples = []
        for name, index in sorted(class_to_idx.items()):
            class_dir = class_dirs[name]
            walked = []
            for folder, folders, files in os.walk(class_dir, onerror=_raise, followlinks=True):
                folders[:] = [f for f in folders if not f.startswith(".")]  # never read: skipped
                if folder != class_dir:
                    list_once(folder)
                walked.append((folder, files))
            found = []
            for folder, files in sorted(walked):
                paths = (os.path.join(folder, file) for file in sorted(files))
                found += [(path, index) for path in paths if is_image(path)]
            if not found:
                raise FileNotFoundError(
                    f"no images in {class_dir}. Image files end in {', '.join(EXTENSIONS)}"
                )
            samples += found
        return samples


def _raise(err: OSError) -> None:
    raise err


def image_folder(root: Path, transform, max_pixels: int | None = MAX_IMAGE_PIXELS) -> ImageFolder:
    if not root.is_dir():
        raise UserError(f"data directory {root} does not exist (DATA must hold train/ and val/)")
    loader = functools.partial(load_rgb, max_pixels=max_pixels)
    try:
        dataset = ImageFolder(str(root), transform=transform, loader=loader)
    except OSError as err:  # no class folders, a class folder with no images, no permission
        raise UserError(f"{root}: {err}") from None
    dataset.max_pixels = max_pixels
    return dataset


def loose_warning(dataset: ImageFolder) -> str | None:
    """What a run says of the split's loose images (ImageFolder.loose), which it leaves out: a
    val set poured into val/ beside a few class folders would otherwise score on those alone."""
    if not dataset.loose:
        return None
    return (
        f"{dataset.root}: {len(dataset.loose)} image file(s) in no class folder, left out "
        f"(first: {dataset.loose[0]}); move each into the folder of its class"
    )


def relative_paths(dataset: ImageFolder) -> list[str]:
    """Each sample's path relative to the dataset's root (class/file), in the dataset's order:
    the same on every node, wherever the data is mounted."""
    prefix = os.path.join(dataset.root, "")
    return [p[len(prefix) :] if p.startswith(prefix) else p for p, _ in dataset.samples]


def facts(dataset: ImageFolder) -> dict:
    """The image count and a digest of the sorted file list (paths relative to the split's root,
    with labels): what a checkpoint records, so that resuming on other data is noticed."""
    labels = (label for _, label in dataset.samples)
    pairs = zip(relative_paths(dataset), labels, strict=True)
    return {"images": len(dataset.samples), "digest": digest(pairs)}


def digest(pairs) -> str:
    """Of (path relative to the split, label) pairs, in any order: a packed set's samples give
    the folder's digest when they are its images (data/shards.py)."""
    found = hashlib.sha256()
    for path, label in sorted(pairs):
        found.update(os.fsencode(f"{path}\t{label}\n"))  # names need not be UTF-8
    return found.hexdigest()


def leave_out(dataset: ImageFolder, split: str, paths: frozenset[str]) -> None:
    """Removes the samples whose path relative to DATA (`split/class/file`) is in paths; the
    others keep their order, so every rank that leaves out the same paths has the same list."""
    if not paths:
        return
    names = relative_paths(dataset)
    kept = [
        s for s, name in zip(dataset.samples, names, strict=True) if f"{split}/{name}" not in paths
    ]
    emptied = sorted(set(dataset.class_to_idx.values()) - {label for _, label in kept})
    if emptied:  # as a class folder with no images is refused (ImageFolder.make_dataset)
        first = Path(dataset.root) / dataset.classes[emptied[0]]
        raise UserError(
            f"--bad-images skip leaves no image in {first} ({len(emptied)} class folder(s) of "
            f"{split}/ emptied): every image there is bad; replace them"
        )
    dataset.samples = dataset.imgs = Samples(kept)
