"""Checkpoint files: atomic writes, numbering, retention, integrity checks, safe loading.

Every save writes `checkpoint-<global step>.pt`, then points `checkpoint.pt` at it and deletes
the oldest beyond --keep-last. `model_best.pt` is a separate copy. What a checkpoint holds is the
Checkpointer's business (state/checkpointer.py).
"""

import io
import os
import pickle
import re
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

import torch

from ddptrain import faults
from ddptrain.errors import UserError, first_line

LATEST, BEST = "checkpoint.pt", "model_best.pt"
NUMBERED = re.compile(r"checkpoint-(\d+)\.pt")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write(path: Path, data: bytes, before_rename: Callable[[], None] | None = None) -> None:
    """Readers see the old file or the new one, never a torn one, even after a crash."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o666 & ~_umask())  # mkstemp's 0600 would hide it from others
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if before_rename is not None:
            before_rename()
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _fsync_dir(directory: Path) -> None:
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make renames and deletions in it durable
    finally:
        os.close(dir_fd)


def _link_latest(numbered: Path, latest: Path) -> None:
    """Points `latest` at `numbered` atomically: a hard link renamed into place, so the newest
    checkpoint is not written twice; a copy where the file system has no hard links."""
    tmp = latest.with_name(f".{latest.name}.{os.getpid()}.link")
    tmp.unlink(missing_ok=True)
    try:
        os.link(numbered, tmp)
    except OSError:
        atomic_write(latest, numbered.read_bytes())
        return
    os.replace(tmp, latest)
    _fsync_dir(latest.parent)


def numbered(out_dir: Path) -> list[Path]:
    """The numbered checkpoints in out_dir, newest (highest global step) first."""
    found = [p for p in out_dir.glob("checkpoint-*.pt") if NUMBERED.fullmatch(p.name)]
    return sorted(found, key=lambda p: int(NUMBERED.fullmatch(p.name)[1]), reverse=True)


def save(out_dir: Path, checkpoint: dict, is_best: bool, keep_last: int) -> None:
    """Commits checkpoint-<step>.pt, points checkpoint.pt at it, writes model_best.pt when
    is_best, then deletes numbered checkpoints beyond the newest keep_last. A crash at any point
    leaves the previous checkpoint in place. Call on the main rank only."""
    buffer = io.BytesIO()
    torch.save(checkpoint, buffer)
    data = buffer.getvalue()
    step = checkpoint["global_step"]
    path = out_dir / f"checkpoint-{step:09d}.pt"
    atomic_write(path, data, before_rename=lambda: faults.kill_point("before_rename", step))
    faults.kill_point("after_rename", step)
    _link_latest(path, out_dir / LATEST)
    if is_best:
        atomic_write(out_dir / BEST, data)
    for old in numbered(out_dir)[keep_last:]:
        old.unlink(missing_ok=True)


def remove_stale_temp_files(out_dir: Path) -> None:
    """Temp files of writes that a crash interrupted before their rename: never checkpoints."""
    for tmp in out_dir.glob(".checkpoint*"):
        tmp.unlink(missing_ok=True)


def resolve(resume: str | None, out_dir: Path) -> Path | None:
    """The checkpoint --resume names. `auto`: the newest one in out_dir that is intact (a damaged
    one is skipped with a warning naming it), or None when there is none."""
    if resume is None:
        return None
    if resume != "auto":
        path = Path(resume)
        if not path.is_file():
            raise UserError(f"--resume: no checkpoint at {path}")
        return path
    tried: list[Path] = []
    latest = out_dir / LATEST
    for path in [*numbered(out_dir), *([latest] if latest.is_file() else [])]:
        if any(path.samefile(t) for t in tried):  # checkpoint.pt is a link to a numbered one
            continue
        tried.append(path)
        try:
            if not weights_finite(load(path, mmap=True)):
                raise UserError(f"{path} holds non-finite weights")
            return path
        except UserError as err:
            print(f"warning: --resume auto: skipping {err}", file=sys.stderr, flush=True)
    return None


def weights_finite(checkpoint: dict) -> bool:
    """Whether every floating-point tensor of the model (and its EMA) is finite."""
    states = [checkpoint.get("model", {}), checkpoint.get("model_ema", {}).get("model", {})]
    return all(
        bool(torch.isfinite(t).all())
        for state in states
        for t in state.values()
        if isinstance(t, torch.Tensor) and t.is_floating_point()
    )


def _verify(path: Path) -> None:
    """torch.load does not check the CRCs torch.save writes: a flipped bit in tensor data would
    load silently. zipfile checks them, at memory speed."""
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (OSError, zipfile.BadZipFile, EOFError) as err:
        raise UserError(f"{path} is damaged or not a checkpoint ({err})") from None
    if bad is not None:
        raise UserError(f"{path} is damaged: checksum mismatch in {bad}")


def safe_load(path: Path, what: str, mmap: bool = False) -> object:
    """torch.load with weights_only=True: tensors and plain data only, never code. The one way
    ddptrain reads a file torch.save wrote. `what` names the file in errors ("checkpoint")."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as err:
        # torch's message advises weights_only=False, which is what a hostile file wants.
        found = re.search(r"GLOBAL (\S+)", str(err))
        detail = f"it refers to {found[1]}" if found else first_line(err)
        raise UserError(
            f"{path} is not a readable {what}: {detail}, and ddptrain loads only tensors and "
            "plain data, never code"
        ) from None
    except Exception as err:  # a torn or foreign file: either way not one to use
        raise UserError(f"{path} is not a readable {what} ({first_line(err)})") from None


def load(path: Path, mmap: bool = False) -> dict:
    _verify(path)
    checkpoint = safe_load(path, "ddptrain checkpoint", mmap=mmap)
    if not isinstance(checkpoint, dict) or "model" not in checkpoint:
        raise UserError(f"{path} is not a ddptrain checkpoint (no 'model' entry)")
    return checkpoint
