"""Checkpoint files: atomic writes, numbering, retention, integrity checks, safe loading.

Every save writes `checkpoint-<global step>.pt`, then points `checkpoint.pt` at it and deletes
the oldest beyond --keep-last. `model_best.pt` is a separate copy, committed with its checkpoint
or not at all (save). What a checkpoint holds is the Checkpointer's business
(state/checkpointer.py). Sharded checkpoints are folders (`checkpoint-<global step>.dcp`,
state/sharded.py) numbered, retained, resolved and loaded here with the files.
"""

import contextlib
import io
import os
import pickle
import re
import shutil
import stat
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from ddptrain import faults
from ddptrain.errors import UserError, WriteFailed, first_line, format_bytes, write_failed

LATEST, BEST = "checkpoint.pt", "model_best.pt"
NUMBERED = re.compile(r"checkpoint-(\d+)\.(pt|dcp)")
# What a checkpoint holds and means, raised when that changes. 2: the schedule steps per
# optimizer step (1: per epoch).
FORMAT_VERSION = 2


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write(
    path: Path,
    data: bytes,
    before_rename: Callable[[], None] | None = None,
    named: Path | None = None,
    after_rename: Callable[[], None] | None = None,
) -> None:
    """Readers see the old file or the new one, never a torn one, even after a crash. A write
    that fails (a full disk, an I/O error) removes its temp file and raises WriteFailed, one
    line naming path (or `named`, the file a hidden path stands for), the bytes it needs and
    the free space there. The hooks run just before and just after the file is renamed into
    place."""
    named = named or path
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o666 & ~_umask())  # mkstemp's 0600 would hide it from others
            f.write(data)
            faults.disk_full(named)
            f.flush()
            os.fsync(f.fileno())
        if before_rename is not None:
            before_rename()
        os.replace(tmp, path)
        tmp = None  # committed: nothing left to remove
        if after_rename is not None:
            after_rename()
        fsync_dir(path.parent)
    except BaseException as err:
        if tmp is not None:
            with contextlib.suppress(OSError):  # a failing disk may refuse this too
                Path(tmp).unlink(missing_ok=True)
        if isinstance(err, OSError) and not isinstance(err, WriteFailed):
            raise write_failed(named, err, needed=len(data)) from None
        raise


def fsync_dir(directory: Path) -> None:
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
    try:
        os.replace(tmp, latest)
        fsync_dir(latest.parent)
    except OSError as err:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise write_failed(latest, err) from None


def numbered(out_dir: Path) -> list[Path]:
    """The numbered checkpoints in out_dir (files and sharded folders), newest (highest global
    step) first."""
    found = [p for p in out_dir.glob("checkpoint-*") if NUMBERED.fullmatch(p.name)]
    return sorted(found, key=global_step_of, reverse=True)


def global_step_of(numbered: Path) -> int:
    return int(NUMBERED.fullmatch(numbered.name)[1])


def link_latest(numbered: Path) -> None:
    """Points checkpoint.pt at a numbered checkpoint file (see _link_latest)."""
    _link_latest(numbered, numbered.parent / LATEST)


def serialized(checkpoint: dict) -> bytes:
    """What torch.save writes for checkpoint, to hand to atomic_write."""
    buffer = io.BytesIO()
    torch.save(checkpoint, buffer)
    return buffer.getvalue()


def save(out_dir: Path, checkpoint: dict, is_best: bool, keep_last: int) -> None:
    """Commits checkpoint-<step>.pt and, when is_best, model_best.pt with it, points
    checkpoint.pt at it, then deletes numbered checkpoints beyond the newest keep_last. A crash
    at any point leaves the previous checkpoint in place, and so does a failed write, which
    raises WriteFailed. Call on the main rank only.

    Both or neither: a checkpoint committed without its best copy would carry the raised
    best_acc1 on to every resume, and model_best.pt would never be written again. The copy is
    written first, complete, under a pending name (pending_best), and promoted once the
    checkpoint is committed; a crash between the two renames leaves it to the next start
    (remove_stale_temp_files)."""
    data = serialized(checkpoint)
    step = checkpoint["global_step"]
    path = out_dir / f"checkpoint-{step:09d}.pt"
    pending = pending_best(out_dir / BEST, step) if is_best else None
    committed = False

    def before_commit() -> None:
        if pending is not None:
            best = best_copy(checkpoint)
            best_data = data if best is checkpoint else serialized(best)
            atomic_write(pending, best_data, named=out_dir / BEST)
        faults.kill_point("before_rename", step)

    def mark_committed() -> None:
        nonlocal committed
        committed = True

    try:
        try:
            atomic_write(path, data, before_commit, after_rename=mark_committed)
        except BaseException:
            if pending is not None and not committed:  # else the next start promotes it
                with contextlib.suppress(OSError):  # a failing disk may refuse this too
                    pending.unlink(missing_ok=True)
            raise
        faults.kill_point("after_rename", step)
        if pending is not None:
            promote(pending, out_dir / BEST)
        link_latest(path)
    except WriteFailed as err:
        raise WriteFailed(
            f"{err}; the checkpoints written before it are intact: make room, then continue "
            "with --resume auto"
        ) from None
    for old in numbered(out_dir)[keep_last:]:
        remove(old)


# A best copy (model_best.pt, or model_best.dcp) complete and waiting for its checkpoint, of
# that global step, to be committed.
PENDING_BEST = re.compile(r"\.(model_best\.(?:pt|dcp))\.(\d{9})\.pending")


def pending_best(best: Path, global_step: int) -> Path:
    return best.with_name(f".{best.name}.{global_step:09d}.pending")


def promote(pending: Path, best: Path) -> None:
    """The best copy waiting in `pending` (a file or a sharded folder) becomes `best`: its
    checkpoint is committed."""
    try:
        if pending.is_dir():
            swap_in(pending, best)
        else:
            os.replace(pending, best)
        fsync_dir(best.parent)
    except OSError as err:
        raise write_failed(best, err) from None


def swap_in(tmp: Path, destination: Path) -> None:
    """The folder tmp renamed to destination, whose old version is set aside first: a crash
    between the two renames leaves it as `.NAME.old`, which the next run's start puts back
    (remove_stale_temp_files)."""
    old = destination.with_name(f".{destination.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    with contextlib.suppress(FileNotFoundError):
        os.replace(destination, old)
    os.replace(tmp, destination)
    shutil.rmtree(old, ignore_errors=True)


# What a best copy whose model is the EMA's weights holds besides: it evaluates, but training
# cannot continue from it (state/resume.check_trainable).
EMA_MARK = {"weights": "model_ema"}


def holds_ema_weights(checkpoint: dict) -> bool:
    return checkpoint.get("weights") == EMA_MARK["weights"]


def best_copy(checkpoint: dict) -> dict:
    """What model_best.pt holds: the checkpoint, with the EMA's weights as its `model` when the
    average evaluated better (best_model "model_ema"), so that export, --evaluate, --pretrained
    and any tool that reads `model` take the weights that scored best_acc1. `weights` marks
    such a copy: its model is not the one training continues from."""
    if checkpoint.get("best_model") != "model_ema":
        return checkpoint
    return {**checkpoint, "model": checkpoint["model_ema"]["model"], **EMA_MARK}


def remove(path: Path) -> None:
    """A checkpoint file, or a sharded checkpoint's folder."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


# Temp names of every write into the out-dir, in full: the out-dir may be a user's working
# directory, whose own `.checkpoints/` folder or `.config.json.bak` must stay. atomic_write's
# `.NAME.XXXXXXXX.tmp` (mkstemp's random part; checkpoint.pt too, copied where the file system
# has no hard links), the `latest` links' `.checkpoint.pt.PID.link`, the profiler's
# `.profile.json.PID.tmp`, sharded saves' `.checkpoint-<step>.dcp.tmp` folders, the best
# copy's `.model_best.dcp.tmp` (an earlier ddptrain named it `.model_best.dcp.ema.tmp`), the
# `.NAME.dcp.old` set aside by swap_in once its replacement is in place, and a best copy
# pending for a checkpoint that was never committed.
_OWN_FILES = (
    r"checkpoint-\d{9}\.pt|checkpoint\.pt|model_best\.pt|config\.json|metrics\.jsonl"
    rf"|summary\.csv|metrics\.png|profile\.json|{PENDING_BEST.pattern}"
)
STALE_TEMP_NAME = re.compile(
    rf"\.(?:{_OWN_FILES})\.\w+\.tmp"
    r"|\.checkpoint\.(?:pt|dcp)\.\d+\.link"
    r"|\.checkpoint-\d{9}\.dcp\.tmp"
    r"|\.model_best\.dcp(?:\.ema)?\.tmp"
    r"|\.(?:model_best|checkpoint-\d{9})\.dcp\.old"
    rf"|{PENDING_BEST.pattern}"
)


def remove_stale_temp_files(out_dir: Path) -> None:
    """Temp files of writes that a crash interrupted before their rename: never checkpoints.
    Before they go, a best copy whose checkpoint was committed before the crash is promoted
    (save), and then a folder that a crash left set aside between the two renames that replace
    it (swap_in: NAME to `.NAME.old`, then the new one to NAME) is put back. In that order: a
    checkpoint put back from `.NAME.old` is an earlier save's, not the pending copy's."""
    for pending in out_dir.glob(".model_best.*.pending"):
        found = PENDING_BEST.fullmatch(pending.name)
        if found and (out_dir / f"checkpoint-{found[2]}{Path(found[1]).suffix}").exists():
            promote(pending, out_dir / found[1])
    for aside in out_dir.glob(".*.dcp.old"):
        original = out_dir / aside.name.removeprefix(".").removesuffix(".old")
        if not original.exists():
            os.replace(aside, original)
    for tmp in out_dir.glob(".*"):
        if STALE_TEMP_NAME.fullmatch(tmp.name):
            remove(tmp)


# A save holds, at its peak, the kept numbered checkpoints, the one being written, and (when val
# accuracy improved) model_best.pt next to the copy replacing it.
PEAK_EXTRA_CHECKPOINTS = 3


def checkpoint_bytes(model: nn.Module, optimizer) -> int:
    """An estimate of one checkpoint's size: weights and buffers, plus the optimizer's state per
    parameter (SGD with momentum keeps one buffer of each parameter's size, Adam two)."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    if isinstance(optimizer, torch.optim.SGD):
        per_param = int(any(group.get("momentum", 0) for group in optimizer.param_groups))
    else:
        per_param = 2  # Adam's two moments; no common optimizer keeps more
    return params * (1 + per_param) + buffers


def room_warning(out_dir: Path, checkpoint_bytes: int, keep_last: int) -> str | None:
    """The warning for an out_dir that lacks the room for the checkpoints this run keeps
    (keep_last, plus those a save holds at its peak), or None. Checkpoints already there count
    as room: they are replaced. Call on the main rank, before the first save."""
    needed = (keep_last + PEAK_EXTRA_CHECKPOINTS) * checkpoint_bytes
    try:
        free = shutil.disk_usage(out_dir).free
    except OSError:
        return None  # the save will say what is wrong
    kept = [*numbered(out_dir), out_dir / LATEST, out_dir / BEST]
    kept += [out_dir / f"{Path(name).stem}.dcp" for name in (LATEST, BEST)]  # sharded format
    # Each file once: checkpoint.pt is a hard link, checkpoint.dcp a symlink, and the files of
    # model_best.dcp hard links.
    sizes = {}
    for path in kept:
        for file in path.rglob("*") if path.is_dir() else [path]:
            with contextlib.suppress(OSError):
                info = file.stat()
                if stat.S_ISREG(info.st_mode):
                    sizes[(info.st_dev, info.st_ino)] = info.st_size
    if free + sum(sizes.values()) >= needed:
        return None
    return (
        f"--out-dir {out_dir} has {format_bytes(free)} free, and this run's checkpoints "
        f"need up to {format_bytes(needed)} (--keep-last {keep_last}, and "
        f"{PEAK_EXTRA_CHECKPOINTS} more during a save, of about {format_bytes(checkpoint_bytes)} "
        "each): saving may fail for lack of space"
    )


def folder_bytes(folder: Path) -> int:
    """What the files in a folder (a sharded checkpoint) take."""
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def resolve(
    resume: str | None, out_dir: Path, skipped: Callable[[str], None] = lambda warning: None
) -> Path | None:
    """The checkpoint --resume names. `auto`: the newest one in out_dir that is intact (each
    damaged one skipped is passed to `skipped`, a warning naming it), or None when there is
    none."""
    if resume is None:
        return None
    if resume != "auto":
        path = Path(resume)
        if not path.exists():  # a folder is a sharded checkpoint: load says if it is not
            raise UserError(f"--resume: no checkpoint at {path}")
        if path.is_dir():  # its bytes, here once: every rank loads it (a file checks its own)
            _sharded().verify(path)
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
            if path.is_dir():
                _sharded().verify(path)
            return path
        except NewerFormat:
            raise  # resuming an older checkpoint instead would fork the run another wrote
        except UserError as err:
            skipped(f"--resume auto skips a checkpoint: {err}")
    return None


def _sharded():
    """The sharded format's module, imported when first needed: it writes through this one."""
    from ddptrain.state import sharded

    return sharded


def weights_finite(checkpoint: dict) -> bool:
    """Whether every floating-point tensor of the model (and its EMA) is finite."""
    ema = checkpoint.get("model_ema")
    states = [checkpoint.get("model"), ema.get("model") if isinstance(ema, dict) else None]
    # A sharded checkpoint's weights (model, EMA) stay on disk: `Stored`, not dicts (each rank
    # checked its own before the save).
    states = [state for state in states if isinstance(state, dict)]
    return all(
        bool(torch.isfinite(t).all())
        for state in states
        for t in state.values()
        if isinstance(t, torch.Tensor) and t.is_floating_point()
    )


def verify(path: Path) -> None:
    """torch.load does not check the CRCs torch.save writes: a flipped bit in tensor data would
    load silently. zipfile checks them, at memory speed."""
    if path.exists() and not path.is_file():  # a FIFO would block the open for good
        raise UserError(f"{path} is not a checkpoint: not a regular file")
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except Exception as err:  # noqa: BLE001 - a damaged header fails in many ways (below)
        # Besides BadZipFile, OSError and EOFError, one flipped bit in a central-directory
        # entry gave, in a trial of each: an "encrypted" file (RuntimeError), another
        # compression (zlib.error, NotImplementedError), an undecodable name
        # (UnicodeDecodeError). Each means the file is damaged.
        raise UserError(f"{path} is damaged or not a checkpoint ({first_line(err)})") from None
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
    if path.is_dir():
        return _sharded().read(path)
    verify(path)
    checkpoint = safe_load(path, "ddptrain checkpoint", mmap=mmap)
    if not isinstance(checkpoint, dict) or "model" not in checkpoint:
        raise UserError(f"{path} is not a ddptrain checkpoint (no 'model' entry)")
    check_format(checkpoint, path)
    return checkpoint


class NewerFormat(UserError):
    """A checkpoint of a later format than this ddptrain reads."""


# What each entry its readers take apart must be, where present: a file made by hand, or damaged
# inside a pickle that still loads, otherwise ends in a traceback deep inside them.
ENTRY_TYPES = {
    "model": dict,
    "model_ema": dict,
    "optimizer": dict,
    "config": dict,
    "class_to_idx": dict,
    "data_facts": dict,
    "arch": str,
    "best_model": str,
    "epoch": int,
    "global_step": int,
    "epoch_step": int,
    "stale_epochs": int,
    "num_classes": int,
    "data_seed": int,
    "best_acc1": (int, float),
}


def check_format(checkpoint: dict, path: Path) -> None:
    """A checkpoint of a later format is refused: this ddptrain would read the parts it knows
    and quietly drop or misread the rest (as a ddptrain from before the EMA's weights were
    sharded restarts the EMA of a folder that shards them). Earlier formats are read as they
    were written. Then each entry is checked against ENTRY_TYPES, the weights as tensors."""
    version = checkpoint.get("format_version", 1)
    if type(version) is not int or version < 1:  # bool is an int too
        raise UserError(f"{path} is not a ddptrain checkpoint (format_version {version!r})")
    if version > FORMAT_VERSION:
        raise NewerFormat(
            f"{path} was written by a newer ddptrain (checkpoint format {version}; this one "
            f"reads formats 1 to {FORMAT_VERSION}): use that ddptrain or a later one"
        )
    for key, kind in ENTRY_TYPES.items():
        value = checkpoint.get(key)
        if value is not None and (not isinstance(value, kind) or isinstance(value, bool)):
            kind_found = type(value).__name__
            raise UserError(
                f"{path} is not a ddptrain checkpoint: its {key!r} is of type {kind_found}"
            )
    weights = checkpoint.get("model") or {}
    odd = next((name for name, value in weights.items() if not torch.is_tensor(value)), None)
    if odd is not None:
        raise UserError(f"{path} is not a ddptrain checkpoint: its weight {odd!r} is no tensor")
