"""Models by torchvision name, optionally from the architecture's default weights."""

import hashlib
from pathlib import Path
from urllib.parse import urlparse

import torch
import torchvision
from torch import nn

from ddptrain.dist.collectives import rank0_first
from ddptrain.dist.env import DistEnv
from ddptrain.errors import UserError, first_line
from ddptrain.state.files import safe_load

# These take their pretrained weights with ImageNet's input transform built in.
TRANSFORM_INPUT = ("googlenet", "inception_v3")


def build_model(arch: str, num_classes: int, image_size: int, pretrained: bool) -> nn.Module:
    """arch with a num_classes head, checked to run on image_size crops.

    The check is one train-mode forward pass on the CPU (train mode: inception's auxiliary head
    needs 299 px): an architecture that cannot take the crop size is a user error, not a
    traceback in the first step. It leaves the weights and BatchNorm statistics as built.
    """
    extra = {"transform_input": True} if pretrained and arch in TRANSFORM_INPUT else {}
    model = torchvision.models.get_model(arch, num_classes=num_classes, **extra)
    # A no-grad forward changes only buffers (BatchNorm statistics): keep those, not the weights.
    as_built = [buffer.clone() for buffer in model.buffers()]
    try:
        with torch.no_grad():
            model(torch.zeros(2, 3, image_size, image_size))
    except (RuntimeError, AssertionError, ValueError) as err:
        raise UserError(
            f"--arch {arch} does not run on {image_size} px crops (--image-size): {first_line(err)}"
        ) from None
    with torch.no_grad():
        for buffer, saved in zip(model.buffers(), as_built, strict=True):
            buffer.copy_(saved)
    return model


def _pretrained_state(arch: str, show_progress: bool) -> dict[str, torch.Tensor]:
    """The arch's default weights from torch hub's cache, downloaded there when absent.

    Not through `weights.get_state_dict`: torch hub unpickles a cached file with
    weights_only=False and checks its hash only while downloading it, so a file planted in the
    cache would run its code. Here the cached file must match the hash its published name
    carries, and is loaded with weights_only=True all the same.
    """
    weights = torchvision.models.get_model_weights(arch).DEFAULT
    name = Path(urlparse(weights.url).path).name
    path = Path(torch.hub.get_dir()) / "checkpoints" / name
    published = torch.hub.HASH_REGEX.search(name)
    if not path.is_file():
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            # Writes a temp file, checks the hash, then renames: never a torn or unverified file.
            torch.hub.download_url_to_file(
                weights.url, str(path), published and published[1], progress=show_progress
            )
        except (OSError, RuntimeError) as err:  # URLError is an OSError; a bad hash a RuntimeError
            raise UserError(
                f"--pretrained: cannot get the {arch} weights from {weights.url} ({err}); "
                f"offline, put that file in {path.parent}"
            ) from None
    if published and not _sha256(path).startswith(published[1]):
        raise UserError(
            f"--pretrained: {path} does not match the published hash of the {arch} weights "
            f"({published[1]}), so it was not loaded; delete it to download it again"
        )
    try:
        return safe_load(path, f"{arch} weights file")
    except UserError as err:
        raise UserError(f"--pretrained: {err}") from None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def load_pretrained(model: nn.Module, arch: str, env: DistEnv) -> None:
    """The arch's default weights, downloaded by rank 0 first; a head of another size stays new.

    A collective: every rank must call it.
    """
    state = rank0_first(env, lambda: _pretrained_state(arch, show_progress=env.is_main))
    own = model.state_dict()
    fits = {k: v for k, v in state.items() if k in own and own[k].shape == v.shape}
    model.load_state_dict(fits, strict=False)
    fresh = sorted(k for k in set(own) - set(fits) if not k.endswith("num_batches_tracked"))
    if env.is_main and fresh:
        print(f"pretrained {arch}: new weights for {', '.join(fresh)}", flush=True)
