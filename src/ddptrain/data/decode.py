"""--decode-device cuda: the loader workers read each JPEG's bytes, and the training process
decodes the batch's JPEGs at once on the GPU (nvJPEG) and runs the transforms there, each
sample under its own augmentation seed, as a worker would have (data/sampler.py): the same
crops, flips, auto-augment and erasing, resampled by the GPU's kernels. Other formats, and JPEGs
that need more than decoding (an EXIF turn, CMYK: folder.load_rgb's jpeg_later), are decoded
and transformed in the workers, file by file.

Nothing here but `decode_jpegs` is CUDA's: on the CPU device (the tests) it gives the workers'
pixels exactly.
"""

import time
import warnings

import torch

from ddptrain.data.folder import Jpeg, decode_rgb
from ddptrain.distributed.env import DistEnv
from ddptrain.errors import UserError

try:  # a GPU machine's own torch may have no TorchCodec built for it
    from torchcodec.decoders import decode_jpeg
except (ImportError, OSError, RuntimeError):
    decode_jpeg = None


def decoder_name() -> str:
    """Which library decodes the JPEGs on the device: what a run says at its start."""
    return "TorchCodec" if decode_jpeg is not None else "torchvision.io (TorchCodec missing)"


def check_device(decode_device: str, env: DistEnv) -> str | None:
    """Refuses --decode-device cuda on a run without CUDA; else the line a run says of it."""
    if decode_device != "cuda":
        return None
    if env.device.type != "cuda":
        raise UserError(
            f"--decode-device cuda needs the run on a CUDA GPU, and it runs on {env.device} "
            "(no CUDA here, or --device cpu); leave --decode-device out to decode on the CPU"
        )
    return f"--decode-device cuda: JPEGs decoded on {env.device} by {decoder_name()} (nvJPEG)"


def defer(dataset) -> None:
    """Makes a split's dataset leave its plain JPEGs encoded (folder.Jpeg). A dataset that
    decodes no files (--dummy) has no such switch, and is left as it is."""
    if hasattr(dataset, "jpeg_later"):
        dataset.jpeg_later = True


class Later:
    """The workers' side of a transform: a JPEG left encoded keeps its sample's seed (the one
    SeededSamples gave the generator); any other image is transformed here."""

    def __init__(self, transform):
        self.transform = transform

    def __call__(self, image):
        if isinstance(image, Jpeg):
            return image._replace(seed=torch.initial_seed())
        return self.transform(image)


def collate(batch: list) -> tuple[list, torch.Tensor]:
    """A batch of Later's samples: its images as a list (Jpegs and uint8 tensors), its labels."""
    images, targets = zip(*batch, strict=True)
    return list(images), torch.tensor(targets)


class DecodedBatches:
    """The loader as the trainer reads it: (uint8 images on the device, targets). Counts the
    JPEGs it decoded and the CPU time this process's thread spent decoding and transforming
    batches (`cpu_seconds`)."""

    def __init__(self, loader, transform, device: torch.device):
        self.loader, self.transform, self.device = loader, transform, device
        self.cpu_seconds, self.jpegs = 0.0, 0

    def __iter__(self):
        for images, targets in self.loader:
            start = time.thread_time()
            batch = self.decode(images)
            self.cpu_seconds += time.thread_time() - start
            self.jpegs += sum(isinstance(image, Jpeg) for image in images)
            yield batch, targets

    def __len__(self) -> int:
        return len(self.loader)

    def decode(self, images: list) -> torch.Tensor:
        at = [i for i, image in enumerate(images) if isinstance(image, Jpeg)]
        try:
            decoded = decode_jpegs([images[i].data for i in at], self.device)
        except RuntimeError:  # a JPEG nvJPEG refuses: the CPU's decoders, or the file named
            decoded = [decode_rgb(images[i].data, images[i].name, None) for i in at]
        out = list(images)  # the workers' own tensors where nothing was left encoded
        for i, image in zip(at, decoded, strict=True):
            with torch.random.fork_rng(devices=[]):
                # The transforms draw their parameters from the CPU generator, on any device.
                torch.default_generator.manual_seed(images[i].seed)
                out[i] = self.transform(image)
        return torch.stack([image.to(self.device, non_blocking=True) for image in out])


def decode_jpegs(data: list[bytes], device: torch.device) -> list[torch.Tensor]:
    """JPEGs as uint8 RGB tensors on device, in one batched call (nvJPEG on CUDA)."""
    if not data:
        return []
    if decode_jpeg is not None:
        return decode_jpeg(list(data), mode="RGB", device=device)
    return torchvision_decode_jpegs(data, device)


def torchvision_decode_jpegs(data: list[bytes], device: torch.device) -> list[torch.Tensor]:
    """torchvision.io's batched decode, where TorchCodec is missing: deprecated since
    torchvision 0.29, whose warning is silenced here alone."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The image decoding", DeprecationWarning)
        from torchvision.io import ImageReadMode
        from torchvision.io import decode_jpeg as torchvision_decode_jpeg

        encoded = [torch.frombuffer(bytearray(d), dtype=torch.uint8) for d in data]
        return torchvision_decode_jpeg(encoded, mode=ImageReadMode.RGB, device=device)
