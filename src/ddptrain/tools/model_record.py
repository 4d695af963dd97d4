"""What a model file records of its model (an export's JSON, a checkpoint's fields and settings),
checked before any of it is used: a file damaged or edited by hand is one line naming the field,
not a traceback where the field is first used."""

import json
import math
from pathlib import Path

from ddptrain.config import ModelSettings
from ddptrain.errors import UserError

# What predict needs of an export's JSON (export.describe writes them all); what tells one from
# another JSON file, such as a run's config.json, which has neither num_classes nor classes.
NEEDED = (
    "arch",
    "num_classes",
    "classes",
    "image_size",
    "val_resize",
    "interpolation",
    "mean",
    "std",
)


def is_description(path: Path) -> bool:
    try:
        said = json.loads(path.read_text())
    except (OSError, ValueError):  # a folder, not UTF-8, not JSON
        return False
    return isinstance(said, dict) and all(key in said for key in NEEDED)


# A checkpoint's names for the fields check checks, where they are its config's.
IN_CHECKPOINT = {
    "model_image_size": "config.image_size",
    "image_size": "config.val_crop",
    **{key: f"config.{key}" for key in ("val_resize", "interpolation", "mean", "std")},
}
DAMAGED_CHECKPOINT = "a damaged checkpoint, or not one ddptrain wrote"
DAMAGED_DESCRIPTION = "write it again with `ddptrain export CKPT --out W.safetensors`"
INTERPOLATIONS = ("bilinear", "bicubic", "nearest")  # --interpolation's choices
LEAST_SIZE = 16  # pixels, as --image-size and --val-crop take


def check(fields: dict, source: str, names: dict, remedy: str) -> None:
    """A model file's record of its model, checked before any of it is used, so that a file
    damaged or edited by hand is one line naming the field, not a traceback where the field is
    first used. `fields`: as export's JSON names them; those checked are arch, num_classes,
    classes (a checkpoint's class_to_idx), image_size, model_image_size, val_resize,
    interpolation, mean and std, where recorded. `names`: the file's own names where they
    differ; `source`: the file and how it says ("MODEL W.safetensors: W.json says"); `remedy`:
    what to do about a bad field."""
    for key, check in _CHECKS.items():
        problem = check(fields[key]) if key in fields else None
        if problem:
            shown = f"{names.get(key, key)} is {_shown(fields[key])}"
            raise UserError(f"{source} {shown}: {problem}; {remedy}")
    classes_key = "classes" if "classes" in fields else "class_to_idx"
    count = len(fields[classes_key])
    if fields.get("num_classes", count) != count:
        raise UserError(
            f"{source} num_classes is {fields['num_classes']}, and {classes_key} names {count} "
            f"classes: the model's outputs need a name each; {remedy}"
        )
    crop = fields.get("image_size", fields.get("model_image_size"))
    if fields.get("val_resize", crop) < crop:
        raise UserError(
            f"{source} {names.get('val_resize', 'val_resize')} is {fields['val_resize']}: "
            f"smaller than the crop, {crop}; {remedy}"
        )


def _arch_problem(arch) -> str | None:
    if isinstance(arch, str):
        try:
            ModelSettings(arch=arch).check_arch()
            return None
        except UserError:  # its message is --arch's
            pass
    return "no model this torchvision or timm builds (trained with newer versions of them?)"


def _count_problem(num_classes) -> str | None:
    return None if _whole(num_classes) and num_classes >= 1 else "not a whole number above 0"


def _names_problem(classes) -> str | None:
    names = isinstance(classes, list) and all(isinstance(name, str) for name in classes)
    return None if names else "not a list of names"


def _index_map_problem(class_to_idx) -> str | None:
    if isinstance(class_to_idx, dict) and not _names_problem(list(class_to_idx)):
        indices = list(class_to_idx.values())
        if all(map(_whole, indices)) and sorted(indices) == list(range(len(indices))):
            return None
    return "not a map of class names to 0, 1, ... (one index each)"


def _size_problem(size) -> str | None:
    if _whole(size) and size >= LEAST_SIZE:
        return None
    return f"not a whole number of pixels, at least {LEAST_SIZE}"


def _interpolation_problem(how) -> str | None:
    return None if how in INTERPOLATIONS else f"not one of {', '.join(INTERPOLATIONS)}"


def _mean_problem(values) -> str | None:
    numbers = isinstance(values, (list, tuple)) and len(values) == 3
    return None if numbers and all(map(_real, values)) else "not 3 numbers"


def _std_problem(values) -> str | None:
    if _mean_problem(values) is None and min(values) > 0:
        return None
    return "not 3 numbers above 0"


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _real(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _shown(value) -> str:
    """value as Python writes it, cut short: a list of a thousand class names is not shown."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


_CHECKS = {
    "arch": _arch_problem,
    "num_classes": _count_problem,
    "classes": _names_problem,
    "class_to_idx": _index_map_problem,
    "image_size": _size_problem,
    "model_image_size": _size_problem,
    "val_resize": _size_problem,
    "interpolation": _interpolation_problem,
    "mean": _mean_problem,
    "std": _std_problem,
}
