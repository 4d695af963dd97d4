"""`ddptrain export CKPT --out W.safetensors`: a checkpoint's weights for use outside ddptrain.

W.safetensors holds the model's state dict (it loads strictly into the library's model: for
torchvision, `torchvision.models.get_model(arch, num_classes=num_classes)`; for timm,
`timm.create_model(timm_name, **create_model_kwargs)`, the class count and, for models built for
one image size, img_size); safetensors files hold tensors only, so loading one never runs code.
W.json, beside it, says which model it is (library, arch, num_classes) and how to feed it:
classes (names in index order), image_size, val_resize, interpolation, mean, std; and
model_image_size, the size the model was built and trained for (--image-size), which differs from
image_size, the evaluation's crop, where --val-crop was given.
"""

import json
from pathlib import Path

from safetensors.torch import save

from ddptrain.config import Config
from ddptrain.data.transforms import normalization, val_sizes
from ddptrain.errors import UserError
from ddptrain.model.providers import provider
from ddptrain.state import files, sharded
from ddptrain.tools import model_record

SUFFIX = ".safetensors"


def sidecar_path(weights: Path) -> Path:
    return weights.with_suffix(".json")


def export(checkpoint_path: Path, out: Path) -> dict:
    """Writes out and its JSON sidecar, each atomically; returns the sidecar's contents."""
    if out.suffix != SUFFIX:
        raise UserError(f"export: --out {out} must end in {SUFFIX} (W.json goes beside it)")
    check_out(out)
    if not checkpoint_path.exists():
        raise UserError(f"export: no checkpoint at {checkpoint_path}")
    # A sharded folder is gathered here, in this one process, as `ddptrain convert` does.
    load = sharded.to_single if checkpoint_path.is_dir() else files.load
    checkpoint = load(checkpoint_path)
    description = describe(checkpoint, checkpoint_path)
    # safetensors stores each tensor's bytes in row-major order: views must be made whole.
    tensors = {name: tensor.contiguous() for name, tensor in checkpoint["model"].items()}
    # The arch travels inside the file too, so --pretrained can refuse one for another model
    # even without its sidecar.
    metadata = {"format": "pt", "arch": description["arch"]}
    metadata["num_classes"] = str(description["num_classes"])
    # save() and the project's atomic writer rather than save_file(), which writes in place: a
    # failed export must not leave a torn file where an earlier export was.
    files.atomic_write(out, save(tensors, metadata=metadata))
    sidecar = json.dumps(description, indent=2) + "\n"
    files.atomic_write(sidecar_path(out), sidecar.encode())
    return description


def check_out(out: Path) -> None:
    """Refuses an --out that could not be written, or whose JSON would replace a file that is
    not an export's description (`--out RUN/config.safetensors` would put it in place of the
    run's config.json), before anything is read or written. An earlier export's is replaced."""
    if out.is_dir():
        raise UserError(f"export: --out {out} is a directory; give the file to write")
    if not out.parent.is_dir():
        raise UserError(f"export: --out {out}: no directory {out.parent}")
    sidecar = sidecar_path(out)
    if sidecar.exists() and not model_record.is_description(sidecar):
        raise UserError(
            f"export: --out {out}: the JSON written beside it would replace {sidecar}, which "
            "is not an export's description; give --out another name"
        )


def describe(checkpoint: dict, path: Path, what: str = "export:") -> dict:
    """What a user of the weights needs besides them, from the checkpoint and its config.
    `what` names path in errors."""
    config = checkpoint.get("config") or {}
    missing = [key for key in ("arch", "class_to_idx") if key not in checkpoint]
    missing += [] if "image_size" in config else ["config.image_size"]
    if missing:
        raise UserError(f"{what} {path} lacks {', '.join(missing)}: not a ddptrain training run")
    class_to_idx, num_classes = checkpoint["class_to_idx"], checkpoint.get("num_classes")
    recorded = {
        "arch": checkpoint["arch"],
        "class_to_idx": class_to_idx,
        "num_classes": num_classes,
        "model_image_size": config["image_size"],
        "image_size": config.get("val_crop"),  # the crop; --image-size's unless given
        **{key: config.get(key) for key in ("val_resize", "interpolation", "mean", "std")},
    }
    recorded = {key: value for key, value in recorded.items() if value is not None}
    said = f"{what} {path} says"
    model_record.check(recorded, said, model_record.IN_CHECKPOINT, model_record.DAMAGED_CHECKPOINT)
    sizes = {key: config.get(key) for key in ("val_crop", "val_resize", "mean", "std")}
    data = Config(image_size=config["image_size"], **sizes).data
    resize, crop = val_sizes(data)
    mean, std = normalization(data)
    arch = checkpoint["arch"]
    num_classes = len(class_to_idx) if num_classes is None else num_classes
    maker = provider(arch)
    built_by = {}
    if maker.library == "timm":  # how to build the model these weights load into
        built_by = {
            "timm_name": maker.model_name(arch),
            "create_model_kwargs": maker.model_kwargs(arch, num_classes, data.image_size),
        }
    return {
        "library": maker.library,
        "arch": arch,
        "num_classes": num_classes,
        # What the model was built for (a ViT's position embedding: one entry per patch).
        "model_image_size": int(data.image_size),
        **built_by,
        "classes": sorted(class_to_idx, key=class_to_idx.get),
        # What the model was evaluated on (the val preset): resize the short side, centre-crop.
        "image_size": int(crop),
        "val_resize": int(resize),
        "interpolation": config.get("interpolation") or "bilinear",
        "mean": list(mean),
        "std": list(std),
    }
