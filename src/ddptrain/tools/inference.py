"""A trained model as inference uses it: its weights, from a checkpoint, a sharded checkpoint
folder or a `ddptrain export` (.safetensors and its JSON), and the description export writes
beside them (arch, classes, the val preset's sizes and normalisation), which also builds the
val transform. `ddptrain predict` and `ddptrain export --format onnx` start here."""

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn
from torchvision.transforms import v2

from ddptrain.config import Config
from ddptrain.data.transforms import build_val_transform
from ddptrain.errors import UserError, first_line
from ddptrain.model.build import build_model
from ddptrain.state import files, sharded
from ddptrain.tools import model_record
from ddptrain.tools.export import SUFFIX, describe, sidecar_path


@dataclass
class Trained:
    model: nn.Module  # in eval mode, on the CPU
    description: dict  # as export's JSON: arch, num_classes, classes, image_size, ...

    @property
    def classes(self) -> list[str]:
        return self.description["classes"]

    def val_transform(self) -> v2.Compose:
        """uint8 (3, H, W) -> uint8 (3, C, C): the transform the model was evaluated with."""
        d = self.description
        sizes = dict(image_size=d["image_size"], val_resize=d["val_resize"])
        return build_val_transform(Config(**sizes, interpolation=d["interpolation"]).data)


def load_trained(path: Path, ema: bool = False, what: str = "MODEL") -> Trained:
    """The model at path, its weights loaded strictly; ema: the EMA's weights, which a
    checkpoint of a --model-ema run holds besides the model's. `what` names path in errors."""
    if not path.exists():
        raise UserError(f"{what} {path} does not exist")
    if path.suffix == SUFFIX:
        if ema:
            raise UserError(f"--ema: {path} is an export, which holds one set of weights")
        weights, description = _read_export(path, what)
    else:
        # A sharded folder is gathered here, in this one process, as `ddptrain export` does.
        checkpoint = sharded.to_single(path) if path.is_dir() else files.load(path)
        description = describe(checkpoint, path, what)
        weights = _checkpoint_weights(checkpoint, path, ema)
    arch, num_classes = description["arch"], description["num_classes"]
    # Built for the training size, which the val crop need not be; exports written before
    # model_image_size was recorded name only the crop.
    size = description.get("model_image_size", description["image_size"])
    model = build_model(arch, num_classes, size, pretrained=False)
    try:
        model.load_state_dict(weights)
    except RuntimeError as err:
        raise UserError(f"{what} {path} does not fit {arch} ({first_line(err)})") from None
    return Trained(model.eval(), description)


def _checkpoint_weights(checkpoint: dict, path: Path, ema: bool) -> dict[str, torch.Tensor]:
    if not ema or files.holds_ema_weights(checkpoint):  # a model_best.pt of the EMA's already
        return checkpoint["model"]
    if "model_ema" not in checkpoint:
        raise UserError(f"--ema: {path} holds no EMA of the weights (trained without --model-ema)")
    return checkpoint["model_ema"]["model"]


def _read_export(path: Path, what: str) -> tuple[dict[str, torch.Tensor], dict]:
    """The weights, and the JSON export wrote beside them (the model's classes and input)."""
    description_path = sidecar_path(path)
    try:
        description = json.loads(description_path.read_text())
    except (OSError, ValueError) as err:
        raise UserError(
            f"{what} {path}: cannot read {description_path} ({first_line(err)}), which "
            "`ddptrain export` writes beside the weights and names the model and its classes"
        ) from None
    needed = model_record.NEEDED
    missing = [key for key in needed if not isinstance(description, dict) or key not in description]
    if missing:
        raise UserError(f"{what} {path}: {description_path} lacks {', '.join(missing)}")
    said = f"{what} {path}: {description_path} says"
    model_record.check(description, said, {}, model_record.DAMAGED_DESCRIPTION)
    try:
        weights = load_file(path)
    except (SafetensorError, OSError) as err:
        raise UserError(
            f"{what} {path} is not a readable safetensors file ({first_line(err)})"
        ) from None
    return weights, description
