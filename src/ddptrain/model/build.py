"""Models by --arch (model/providers.py), optionally from pretrained weights: the
architecture's published weights, a `ddptrain export` (.safetensors) or a ddptrain checkpoint."""

import hashlib
import json
from pathlib import Path
from urllib.parse import urlparse

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file
from torch import nn

from ddptrain.config import Config
from ddptrain.data.transforms import normalization
from ddptrain.distributed.collectives import agree, rank0_first
from ddptrain.distributed.env import DistEnv
from ddptrain.errors import UserError, first_line
from ddptrain.model.providers import provider
from ddptrain.state.files import load as load_checkpoint
from ddptrain.state.files import safe_load


class CropError(UserError):
    """The architecture does not run on crops of this size; `reason` is the model's own word."""

    def __init__(self, arch: str, image_size: int, reason: str):
        super().__init__(
            f"--arch {arch} does not run on {image_size} px crops (--image-size): {reason}"
        )
        self.reason = reason


def build_model(
    arch: str,
    num_classes: int,
    image_size: int,
    pretrained: bool | str,
    meta: bool = False,
    drop_path: float = 0.0,
) -> nn.Module:
    """arch with a num_classes head, checked to run on image_size crops.

    The check is one train-mode forward pass on the CPU (train mode: inception's auxiliary head
    needs 299 px): an architecture that cannot take the crop size is a user error, not a
    traceback in the first step. It leaves the weights and BatchNorm statistics as built.

    meta: the structure only, on the meta device, for a rank that will receive rank 0's weights
    (parallelize.builds_on_meta); unchecked, as rank 0's check speaks for every rank. A model
    that cannot be built there (RegNet) is built with weights. drop_path: --drop-path.
    """
    try:
        # published: the provider's own weights (pretrained=True; a str is a file of ours)
        model = provider(arch).build(
            arch, num_classes, image_size, pretrained is True, meta, drop_path=drop_path
        )
    except AssertionError as err:  # a ViT for crops its patches do not divide
        raise CropError(arch, image_size, first_line(err)) from None
    if next(model.parameters()).is_meta:
        return model
    # A no-grad forward changes only buffers (BatchNorm statistics): keep those, not the weights.
    as_built = [buffer.clone() for buffer in model.buffers()]
    try:
        with torch.no_grad():
            model(torch.zeros(2, 3, image_size, image_size))
    except (RuntimeError, AssertionError, ValueError) as err:
        raise CropError(arch, image_size, first_line(err)) from None
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
    url = provider(arch).weights_url(arch)
    name = Path(urlparse(url).path).name
    path = Path(torch.hub.get_dir()) / "checkpoints" / name
    published = torch.hub.HASH_REGEX.search(name)
    if not path.is_file():
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            # Writes a temp file, checks the hash, then renames: never a torn or unverified file.
            torch.hub.download_url_to_file(
                url, str(path), published and published[1], progress=show_progress
            )
        except (OSError, RuntimeError) as err:  # URLError is an OSError; a bad hash a RuntimeError
            raise UserError(
                f"--pretrained: cannot get the {arch} weights from {url} ({err}); "
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


def load_pretrained(
    model: nn.Module,
    arch: str,
    env: DistEnv,
    source: bool | str = True,
    classes: list[str] | None = None,
    image_size: int | None = None,
) -> list[str]:
    """Initial weights for model: source True is the arch's default published weights
    (downloaded by rank 0 first; a timm model's adapted to `image_size`), a str the path of a
    .safetensors file (an export, or timm's own) or a ddptrain checkpoint. A head of another
    class count stays new; returns the names left new (the caller's Reporter says so).
    `classes`, the data's class names in index order, asks for weights that already know them
    (--evaluate): a head left new is refused, and so is a file that names other classes.

    A collective: every rank must call it. A model on the meta device is left as it is: its
    rank receives rank 0's weights when it is wrapped.
    """
    if next(model.parameters()).is_meta:
        fresh = rank0_first(env, lambda: [])
    elif source is True and provider(arch).library == "timm":
        # rank 0 first: it downloads, the others find the weights in the cache
        size = image_size or 224
        num_classes = model.num_classes
        state = rank0_first(env, lambda: provider(arch).published_state(arch, num_classes, size))
        fresh = _load_fitting(model, state)
    elif source is True:
        state = rank0_first(env, lambda: _pretrained_state(arch, show_progress=env.is_main))
        fresh = _load_fitting(model, state)
    else:
        # Loaded inside the collective: a file that does not fit ends every rank.
        fresh = rank0_first(env, lambda: _load_file(model, arch, Path(source), classes))
    if classes is not None:  # agreed: a rank built on the meta device knows of no head
        what = f"{provider(arch).library}'s {arch}" if source is True else str(source)
        agree(env, lambda: _check_head(fresh, what, len(classes)))
    return fresh


def _check_head(fresh: list[str], what: str, num_classes: int) -> None:
    if fresh:
        raise UserError(
            f"--evaluate --pretrained: the weights of {what} are for another number of classes "
            f"than the data's {num_classes}, so the head ({', '.join(fresh)}) would be new, "
            "random weights: evaluate weights trained on these classes"
        )


def _load_fitting(model: nn.Module, state: dict[str, torch.Tensor]) -> list[str]:
    """torchvision's weights: those whose shape fits (1000 classes rarely do in the head)."""
    own = model.state_dict()
    fits = {k: v for k, v in state.items() if k in own and own[k].shape == v.shape}
    model.load_state_dict(fits, strict=False)
    return sorted(k for k in set(own) - set(fits) if not k.endswith("num_batches_tracked"))


def _load_file(model: nn.Module, arch: str, path: Path, classes: list[str] | None) -> list[str]:
    """Every weight of the file into model, strictly, but for a classifier head of another
    class count, which stays new. A file for another arch is refused, and one for other
    classes than `classes` (when given, and the file says its own)."""
    state, file_arch, file_classes = _read_weights_file(path)
    if file_arch is not None and file_arch != arch:
        raise UserError(
            f"--pretrained: {path} holds {file_arch} weights, not --arch {arch}: "
            f"pass -a {file_arch}, or a file for {arch}"
        )
    if classes is not None and file_classes is not None:
        _check_classes(path, classes, file_classes)
    own = model.state_dict()
    missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    if missing or unexpected:
        raise UserError(
            f"--pretrained: {path} does not fit --arch {arch}: {len(missing)} weights missing "
            f"({', '.join(missing[:3]) or 'none'}), {len(unexpected)} unexpected "
            f"({', '.join(unexpected[:3]) or 'none'})"
        )
    head = _head_of_other_class_count(own, state, provider(arch).classifier_names(model), path)
    model.load_state_dict({k: v for k, v in state.items() if k not in head}, strict=False)
    return head


def _check_classes(path: Path, classes: list[str], theirs: list[str]) -> None:
    """--evaluate: weights trained on the data's classes, in its order (a count of their own is
    the head's check)."""
    if len(theirs) != len(classes) or theirs == classes:
        return
    i = next(i for i, (ours, its) in enumerate(zip(classes, theirs, strict=True)) if ours != its)
    raise UserError(
        f"--evaluate --pretrained: {path} was trained on other classes than the data's: class "
        f"{i} is {theirs[i]!r} there and {classes[i]!r} here"
    )


def _head_of_other_class_count(own: dict, state: dict, heads: set[str], path: Path) -> list[str]:
    """The weights whose shapes differ, provided they are the classifiers' (`heads`: fc, or
    inception's and googlenet's auxiliary heads too) and differ only as those of another class
    count do: in the first dimension, by the same two counts everywhere. Any other weight of
    another shape is refused: it would start random, unsaid."""

    def head_like(k: str) -> bool:
        here, there = own[k].shape, state[k].shape
        return k in heads and len(here) == len(there) >= 1 and here[1:] == there[1:]

    differ = sorted(k for k in own if own[k].shape != state[k].shape)
    counts = {(own[k].shape[0], state[k].shape[0]) for k in differ if head_like(k)}
    if differ and not (all(map(head_like, differ)) and len(counts) == 1):
        k = next((k for k in differ if not head_like(k)), differ[0])
        raise UserError(
            f"--pretrained: {path} does not fit this model: {k} is {tuple(state[k].shape)} "
            f"there and {tuple(own[k].shape)} here (only the classifier's weights may differ: "
            "those of another class count)"
        )
    return differ


def _read_weights_file(path: Path) -> tuple[dict[str, torch.Tensor], str | None, list | None]:
    """(state dict, arch and class names in index order where the file says) of a .safetensors
    export (its names in the W.json beside it) or a ddptrain checkpoint, neither read in a way
    that could run code."""
    if path.is_dir() or not path.exists():
        what = "is a directory" if path.is_dir() else "does not exist"
        raise UserError(
            f"--pretrained: {path} {what}; give a .safetensors file from `ddptrain export` or "
            "a ddptrain checkpoint (or --pretrained alone for the arch's published weights)"
        )
    if path.suffix == ".safetensors":
        try:
            with safe_open(path, framework="pt") as f:
                arch = (f.metadata() or {}).get("arch")
            return load_file(path), arch, _exported_classes(path.with_suffix(".json"))
        except (SafetensorError, OSError) as err:
            raise UserError(
                f"--pretrained: {path} is not a readable safetensors file ({first_line(err)})"
            ) from None
    try:
        checkpoint = load_checkpoint(path)
    except UserError as err:
        raise UserError(f"--pretrained: {err}") from None
    class_to_idx = checkpoint.get("class_to_idx")
    classes = sorted(class_to_idx, key=class_to_idx.get) if isinstance(class_to_idx, dict) else None
    return checkpoint["model"], checkpoint.get("arch"), classes


def file_preprocessing(path: Path) -> dict | None:
    """The input a ddptrain run's weights were trained with, by flat setting key (interpolation,
    mean, std): from an export's JSON or a checkpoint's settings. None for a file that does not
    say (timm's own .safetensors), or that cannot be read (loading it later says why)."""
    if path.suffix == ".safetensors":
        try:
            theirs = json.loads(path.with_suffix(".json").read_text())
        except (OSError, ValueError):
            return None
    else:
        try:  # mapped, not read or verified (loading it does): only its settings are wanted
            checkpoint = safe_load(path, "ddptrain checkpoint", mmap=True)
        except UserError:
            return None
        theirs = checkpoint.get("config") if isinstance(checkpoint, dict) else None
    if not isinstance(theirs, dict):
        return None
    # A run without --mean and --std normalised by ImageNet's.
    data = Config(mean=_triple(theirs.get("mean")), std=_triple(theirs.get("std"))).data
    mean, std = normalization(data)
    interpolation = theirs.get("interpolation") or "bilinear"
    return {"interpolation": interpolation, "mean": tuple(mean), "std": tuple(std)}


def _triple(values) -> tuple | None:
    return tuple(values) if isinstance(values, (list, tuple)) and len(values) == 3 else None


def _exported_classes(description: Path) -> list | None:
    """The class names `ddptrain export` wrote beside the weights, if it is there and says."""
    try:
        classes = json.loads(description.read_text()).get("classes")
    except (OSError, ValueError, AttributeError):
        return None
    return classes if isinstance(classes, list) else None
