"""Checkpoints: atomic writes by the main rank, strict loading, resume.

Format (DESIGN.md): a dict loadable with torch.load(weights_only=True) holding `model` (plain
state dict, no wrapper prefixes, CPU tensors), `arch`, `num_classes`, `class_to_idx`, `epoch`
(epochs completed), `optimizer` (keyed by parameter name), `scheduler`, `best_acc1`, `config`,
`format_version`, and `global_step`.
"""

import io
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from ddptrain.errors import UserError, first_line

FORMAT_VERSION = 1
LATEST, BEST = "checkpoint.pt", "model_best.pt"


@dataclass
class TrainState:
    epoch: int = 0  # epochs completed
    global_step: int = 0
    best_acc1: float = 0.0


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write(path: Path, data: bytes) -> None:
    """Readers see the old file or the new one, never a torn one, even after a crash."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o666 & ~_umask())  # mkstemp's 0600 would hide it from others
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)


def _to_cpu(tree):
    if isinstance(tree, torch.Tensor):
        return tree.detach().cpu()
    if isinstance(tree, dict):
        return {k: _to_cpu(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_to_cpu(v) for v in tree]
    return tree


def payload(model: nn.Module, optimizer, scheduler, state: TrainState, meta: dict) -> dict:
    """What goes into a checkpoint. `model` is the unwrapped module, so keys carry no prefixes;
    the state-dict API keys optimizer state by parameter name rather than position."""
    model_state, optim_state = get_state_dict(model, optimizer)
    return {
        "format_version": FORMAT_VERSION,
        "model": _to_cpu(model_state),
        "optimizer": _to_cpu(optim_state),
        "scheduler": scheduler.state_dict(),
        "epoch": state.epoch,
        "global_step": state.global_step,
        "best_acc1": state.best_acc1,
        **meta,
    }


def save(out_dir: Path, checkpoint: dict, is_best: bool) -> None:
    """Writes checkpoint.pt, and model_best.pt when is_best. Call on the main rank only."""
    buffer = io.BytesIO()
    torch.save(checkpoint, buffer)
    data = buffer.getvalue()
    atomic_write(out_dir / LATEST, data)
    if is_best:
        atomic_write(out_dir / BEST, data)


def resolve(resume: str | None, out_dir: Path) -> Path | None:
    """The checkpoint --resume names: `auto` is out-dir's latest when it exists."""
    if resume is None:
        return None
    if resume == "auto":
        latest = out_dir / LATEST
        return latest if latest.is_file() else None
    path = Path(resume)
    if not path.is_file():
        raise UserError(f"--resume: no checkpoint at {path}")
    return path


def load(path: Path) -> dict:
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # a torn, foreign or unsafe file: all mean "not a usable checkpoint"
        raise UserError(f"--resume: {path} is not a readable ddptrain checkpoint ({err})") from None
    if not isinstance(checkpoint, dict) or "model" not in checkpoint:
        raise UserError(f"--resume: {path} is not a ddptrain checkpoint (no 'model' entry)")
    return checkpoint


def check_compatible(checkpoint: dict, path: Path, arch: str, class_to_idx: dict) -> None:
    if checkpoint.get("arch", arch) != arch:
        raise UserError(f"--resume: {path} holds a {checkpoint['arch']} model, not --arch {arch}")
    saved = checkpoint.get("class_to_idx")
    if saved is not None and saved != class_to_idx:
        only_saved = sorted(set(saved) - set(class_to_idx))
        only_data = sorted(set(class_to_idx) - set(saved))
        detail = (
            f"only in the checkpoint: {only_saved}; only in the data: {only_data}"
            if only_saved or only_data
            else "same names, other order"
        )
        raise UserError(f"--resume: {path} was trained on other classes than the data ({detail})")


def restore(checkpoint: dict, model: nn.Module, optimizer, scheduler) -> TrainState:
    """Loads weights (strictly) and, when present, optimizer and schedule into unwrapped model."""
    try:
        if optimizer is not None and "optimizer" in checkpoint:
            set_state_dict(
                model,
                optimizer,
                model_state_dict=checkpoint["model"],
                optim_state_dict=checkpoint["optimizer"],
            )
        else:
            model.load_state_dict(checkpoint["model"], strict=True)
    except (RuntimeError, KeyError, ValueError) as err:
        raise UserError(
            f"--resume: the checkpoint does not fit this model: {first_line(err)}"
        ) from None
    if scheduler is not None and "scheduler" in checkpoint:
        scheduler.load_state_dict(checkpoint["scheduler"])
    return TrainState(
        epoch=int(checkpoint.get("epoch", 0)),
        global_step=int(checkpoint.get("global_step", 0)),
        best_acc1=float(checkpoint.get("best_acc1", 0.0)),
    )
