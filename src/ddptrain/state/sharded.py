"""Sharded checkpoints (--checkpoint-format sharded): one DCP folder per save, each rank writing
the shards it holds, so no host ever gathers the whole model.

`checkpoint-<global step>.dcp/` holds torch.distributed.checkpoint's shard files and `.metadata`
(the model, the optimizer and the EMA of the weights, as the ranks hold them) and `state.pt`:
everything else of the checkpoint (counters, scheduler, run metadata), small plain data that
rank 0 writes. A save goes into a temp folder renamed into place once every rank's shards and
state.pt are in it, so a crash or a failed write never leaves a partial checkpoint under a
checkpoint's name. `checkpoint.dcp` links to the newest, `model_best.dcp` is a copy committed
with it (files.save says why); when the EMA scored best, it is written apart with the EMA's
weights as its model, as files.best_copy does for the single file. DCP reshards on load: a
folder saved on N ranks resumes on any number, under fsdp or ddp.

A checkpoint folder is a file a user hands us, and DCP reads `.metadata` with plain pickle and its
non-tensor items with torch.load(weights_only=False): both go through readers here that accept
plain data only (DCP's own metadata classes, torch sizes and dtypes), never code.
"""

import contextlib
import errno
import io
import os
import pickle
import shutil
import warnings
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter

from ddptrain import faults
from ddptrain.errors import UserError, WriteFailed, first_line, peer_lost, write_failed
from ddptrain.state import files

SUFFIX = ".dcp"
STATE, METADATA = "state.pt", ".metadata"
LATEST, BEST = f"checkpoint{SUFFIX}", f"model_best{SUFFIX}"
# The parts DCP writes shard by shard (those a run has); the rest of a checkpoint goes in
# state.pt. Checkpoints written before the EMA's weights were sharded hold it in state.pt.
SHARDED_PARTS = ("model", "optimizer", "model_ema")

_ALLOWED = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
}


class _PlainDataUnpickler(pickle.Unpickler):
    """Unpickles DCP's metadata: its own dataclasses and enums, torch sizes, dtypes and layouts,
    paths. Anything else (a function, a class of another module) is refused by name.

    Names are taken whole: from pickle protocol 4 on, a dotted name is looked up attribute by
    attribute, and the metadata module imports os and torch, so "os.system" under it would reach
    a function. Of that module, only the classes it defines pass."""

    def find_class(self, module: str, name: str):
        if "." not in name:
            if module == dcp_metadata.__name__:
                found = getattr(dcp_metadata, name, None)
                if isinstance(found, type) and found.__module__ == module:
                    return found
            elif (module, name) in _ALLOWED or (
                module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
            ):
                return super().find_class(module, name)
        raise pickle.UnpicklingError(f"GLOBAL {module}.{name}")


class _SafeReader(FileSystemReader):
    def read_metadata(self, *args, **kwargs) -> dcp_metadata.Metadata:
        return read_metadata(Path(self.path))


class _SafePlanner(DefaultLoadPlanner):
    """DCP's planner, but its non-tensor items (an optimizer's hyperparameters, a step count)
    load as plain data only: its own load_bytes unpickles them with weights_only=False."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        loaded = torch.load(value, weights_only=True)
        *parents, last = self.mappings[read_item.dest_index.fqn]  # where the item sits
        container = self.original_state_dict
        for key in parents:
            container = container[key]
        container[last] = loaded


def read_metadata(folder: Path) -> dcp_metadata.Metadata:
    path = folder / METADATA
    try:
        with path.open("rb") as f:
            metadata = _PlainDataUnpickler(f).load()
    except FileNotFoundError:
        raise UserError(
            f"{folder} is damaged or not a checkpoint: its {METADATA} is missing"
        ) from None
    except pickle.UnpicklingError as err:
        if not str(err).startswith("GLOBAL "):
            raise UserError(f"{path} is damaged ({first_line(err)})") from None
        raise UserError(
            f"{path} is not a readable checkpoint metadata file: it refers to "
            f"{str(err).removeprefix('GLOBAL ')}, and ddptrain loads only plain data, never code"
        ) from None
    except Exception as err:
        raise UserError(f"{path} is damaged ({first_line(err)})") from None
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise UserError(f"{path} is not DCP metadata")
    if metadata.storage_meta is None:
        metadata.storage_meta = dcp_metadata.StorageMeta()
    return metadata


@dataclass
class Stored:
    """A part of a sharded checkpoint, still on disk: what `load_into` reads into a state dict
    of this process's own layout (DCP reshards), and the full shapes check_fits compares."""

    folder: Path
    part: str  # one of SHARDED_PARTS
    metadata: dcp_metadata.Metadata

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Full tensor shapes by key inside the part ("conv1.weight", "state.fc.bias.step")."""
        prefix = f"{self.part}."
        return {
            key.removeprefix(prefix): tuple(item.size)
            for key, item in self.metadata.state_dict_metadata.items()
            if key.startswith(prefix) and isinstance(item, dcp_metadata.TensorStorageMetadata)
        }

    def load_into(self, state_dict: dict) -> None:
        """Fills state_dict (this rank's tensors, sharded or whole) in place. A collective
        where a process group exists."""
        with warnings.catch_warnings(), _damaged(self.folder):
            warnings.simplefilter("ignore", UserWarning)  # "assuming the intent is to load in a..."
            dcp.load(
                {self.part: state_dict},
                storage_reader=_SafeReader(self.folder),
                planner=_SafePlanner(),
            )


def read(folder: Path) -> dict:
    """A sharded checkpoint's state.pt, with its SHARDED_PARTS as `Stored` parts. Checks
    its format, then that the metadata is readable and every shard file it names is there,
    whole."""
    state_path = folder / STATE
    held = files.numbered(folder)
    if held and not (folder / METADATA).exists():
        raise UserError(
            f"{folder} is a run's out-dir, not a checkpoint: give one of its checkpoints (the "
            f"newest: {held[0]})"
        )
    if not state_path.is_file():
        raise UserError(f"{folder} is damaged: its {STATE} is missing")
    checkpoint = files.safe_load(state_path, "ddptrain checkpoint")
    if not isinstance(checkpoint, dict):
        raise UserError(f"{state_path} is not a ddptrain checkpoint")
    files.check_format(checkpoint, folder)
    metadata = read_metadata(folder)
    ends: dict[str, int] = {}
    for item in metadata.storage_data.values():
        ends[item.relative_path] = max(ends.get(item.relative_path, 0), item.offset + item.length)
    for name, end in ends.items():
        try:
            size = (folder / name).stat().st_size
        except OSError:
            raise UserError(f"{folder} is damaged: its shard {name} is missing") from None
        if size < end:
            raise UserError(f"{folder} is damaged: its shard {name} is truncated")
    return {**checkpoint, **{part: Stored(folder, part, metadata) for part in _parts(metadata)}}


def verify(folder: Path) -> None:
    """The CRCs of a sharded checkpoint's every byte, as files.verify checks a file's: DCP's
    load checks none, so a flipped bit in tensor data would load silently. Each item of a shard
    file is an archive torch.save wrote (DCP's FileSystemWriter), at the offset the metadata
    gives. Reads the whole checkpoint: rank 0 alone, once, as it picks what to resume. `read`
    first, which says what is wrong with a folder that is no checkpoint in its own words."""
    read(folder)
    files.verify(folder / STATE)
    items = sorted(read_metadata(folder).storage_data.values(), key=lambda i: i.relative_path)
    for item in items:
        name = item.relative_path
        try:
            with open(folder / name, "rb") as shard:
                shard.seek(item.offset)
                with zipfile.ZipFile(io.BytesIO(shard.read(item.length))) as archive:
                    bad = archive.testzip()
        except Exception as err:  # noqa: BLE001 - as files.verify: each way means damaged
            raise UserError(f"{folder} is damaged: its shard {name} ({first_line(err)})") from None
        if bad is not None:
            raise UserError(f"{folder} is damaged: checksum mismatch in its shard {name}")


def _parts(metadata: dcp_metadata.Metadata) -> list[str]:
    """The SHARDED_PARTS a folder holds."""
    saved = {key.split(".", 1)[0] for key in metadata.state_dict_metadata}
    return [part for part in SHARDED_PARTS if part in saved]


def temp_folder(out_dir: Path, global_step: int) -> Path:
    return out_dir / f".checkpoint-{global_step:09d}{SUFFIX}.tmp"


def best_temp_folder(out_dir: Path) -> Path:
    """Where model_best.dcp is put together before it waits for its checkpoint (commit)."""
    return out_dir / f".{BEST}.tmp"


def prepare(out_dir: Path, global_step: int, best_apart: bool = False) -> None:
    """Rank 0, before the ranks write: an empty temp folder for this save (and one for
    model_best.dcp when it is written apart)."""
    folders = [temp_folder(out_dir, global_step), *[best_temp_folder(out_dir)] * best_apart]
    for tmp in folders:
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            tmp.mkdir()
        except OSError as err:
            raise write_failed(tmp, err) from None


def write_shards(tensors: dict, tmp: Path) -> None:
    """Every rank writes its shards of `tensors` into the save's temp folder `tmp`. DCP's
    collectives gather the plan and every rank's outcome: one rank's failed write fails it on
    every rank."""
    try:
        with warnings.catch_warnings():  # one process: "assuming the intent is to save in a..."
            warnings.simplefilter("ignore", UserWarning)
            dcp.save(tensors, storage_writer=FileSystemWriter(tmp))
    except (Exception, CheckpointException) as err:
        # DCP's save ends together on every rank: no rank still writes into the folder.
        shutil.rmtree(tmp, ignore_errors=True)  # the space a failed save took, back now
        cause = _first_failure(err)
        if isinstance(cause, KeyboardInterrupt) or peer_lost(cause):
            raise cause from None  # Ctrl-C, or a rank gone: reported as such, not as a write
        if isinstance(cause, OSError):
            reason, disk = cause, cause.errno in (errno.ENOSPC, errno.EDQUOT)
        else:  # torch's zip writer reports a full disk as "unexpected pos N vs M"
            reason, disk = OSError(first_line(cause)), True
        failed = write_failed(tmp, reason, needed=_bytes(tensors) if disk else None)
        raise WriteFailed(
            f"{failed}; the checkpoints written before it are intact: fix that, then continue "
            "with --resume auto"
        ) from None


def _first_failure(err: BaseException) -> BaseException:
    """What failed inside DCP. It wraps every rank's exception in one CheckpointException, a
    BaseException (which `except Exception` misses) whose message is every rank's traceback."""
    if isinstance(err, CheckpointException) and err.failures:
        return next(iter(err.failures.values()))[0]
    return err


@contextlib.contextmanager
def _damaged(folder: Path):
    """A shard DCP cannot read (its bytes overwritten, say) is one line naming the folder. DCP
    gathers the failure to every rank, so every rank raises it."""
    try:
        yield
    except CheckpointException as err:
        cause = _first_failure(err)
        if isinstance(cause, OSError | EOFError):
            detail = first_line(cause)
        elif isinstance(cause, pickle.UnpicklingError):
            # torch.load's weights-only refusal of a shard's bytes: a paragraph advising
            # weights_only=False, said here by its type alone
            detail = type(cause).__name__
        else:  # not the bytes: what DCP found missing or mismatched, in its words
            raise UserError(f"cannot load {folder}: {first_line(cause)}") from None
        raise UserError(f"{folder} is damaged: its shards cannot be read ({detail})") from None


def _bytes(value) -> int:
    """The size of the tensors in a state dict (whole, for sharded ones): what its folder needs."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()  # a DTensor's numel is the whole tensor's
    if isinstance(value, dict):
        return sum(_bytes(item) for item in value.values())
    if isinstance(value, list | tuple):
        return sum(_bytes(item) for item in value)
    return 0


def commit(
    out_dir: Path, rest: dict, is_best: bool, keep_last: int, best_apart: bool = False
) -> Path:
    """Rank 0, once every rank's shards are in the temp folder: writes state.pt, renames the
    folder into place with, when is_best, model_best.dcp (a copy of it or, `best_apart`, the
    EMA's folder), links checkpoint.dcp to it, and deletes the oldest checkpoints beyond
    keep_last. The best copy is committed with its checkpoint or not at all, as files.save
    does. A failed write or rename raises WriteFailed (one line) and leaves the checkpoints
    before it as they were."""
    step = rest["global_step"]
    tmp, best_tmp = temp_folder(out_dir, step), best_temp_folder(out_dir)
    path = out_dir / f"checkpoint-{step:09d}{SUFFIX}"
    pending = files.pending_best(out_dir / BEST, step) if is_best else None
    try:
        try:
            files.atomic_write(tmp / STATE, files.serialized(rest))
            if pending is not None:
                _put_best_together(tmp, best_tmp, pending, rest, best_apart, out_dir / BEST)
            files.swap_in(tmp, path)  # over the same step saved before a restart, if any
        except BaseException:
            if pending is not None and tmp.exists():  # its checkpoint not renamed into place
                shutil.rmtree(pending, ignore_errors=True)
            raise
        files.fsync_dir(out_dir)
        if pending is not None:
            files.promote(pending, out_dir / BEST)
        link_latest(path)
    except OSError as err:
        for folder in (tmp, best_tmp):  # a save that did not commit: its space back
            shutil.rmtree(folder, ignore_errors=True)
        failed = err if isinstance(err, WriteFailed) else write_failed(err.filename or path, err)
        raise WriteFailed(
            f"{failed}; the checkpoints written before it are intact: make room, then "
            "continue with --resume auto"
        ) from None
    for old in files.numbered(out_dir)[keep_last:]:
        files.remove(old)
    return path


def _put_best_together(
    tmp: Path, best_tmp: Path, pending: Path, rest: dict, best_apart: bool, best: Path
) -> None:
    """model_best.dcp put together in best_tmp, then renamed to `pending` once complete and
    durable: the EMA's shards (written there by every rank) with a state.pt that marks them,
    or a copy of the complete checkpoint in tmp whose files are hard links where the file
    system has them (its files are never written again, only removed with it, and a model too
    big to gather is too big to copy while the other ranks wait). A failure names `best`."""
    try:
        if best_apart:
            marked = {**rest, **files.EMA_MARK}  # its model is in the folder's shards
            files.atomic_write(best_tmp / STATE, files.serialized(marked), named=best)
        else:
            shutil.rmtree(best_tmp, ignore_errors=True)
            shutil.copytree(tmp, best_tmp, copy_function=_link_or_copy)
        faults.disk_full(best)
        files.fsync_dir(best_tmp)
        shutil.rmtree(pending, ignore_errors=True)
        os.replace(best_tmp, pending)
        files.fsync_dir(pending.parent)  # before the checkpoint's rename, which relies on it
    except (OSError, shutil.Error) as err:
        if isinstance(err, WriteFailed):
            raise
        reason = err if isinstance(err, OSError) else OSError(first_line(err))
        raise write_failed(best, reason, needed=files.folder_bytes(tmp)) from None


def link_latest(folder: Path) -> None:
    """Points checkpoint.dcp at a numbered checkpoint folder: a relative symlink renamed into
    place, so readers see the old one or the new one."""
    link = folder.parent / LATEST
    tmp = link.with_name(f".{link.name}.{os.getpid()}.link")
    tmp.unlink(missing_ok=True)
    os.symlink(folder.name, tmp)
    os.replace(tmp, link)


def _link_or_copy(source: str, destination: str) -> None:
    try:
        os.link(source, destination)
    except OSError:
        shutil.copy2(source, destination)


def to_single(folder: Path) -> dict:
    """The whole checkpoint, loaded in this one process, as the single-file format holds it
    (`ddptrain convert`)."""
    checkpoint = read(folder)
    metadata = checkpoint["model"].metadata
    flat = {
        key: torch.empty(item.size, dtype=item.properties.dtype)
        if isinstance(item, dcp_metadata.TensorStorageMetadata)
        else None  # a non-tensor item: the planner puts what it reads in its place
        for key, item in metadata.state_dict_metadata.items()
    }
    with warnings.catch_warnings(), _damaged(folder):
        warnings.simplefilter("ignore", UserWarning)  # "assuming the intent is to load in a..."
        dcp.load(flat, storage_reader=_SafeReader(folder), planner=_SafePlanner(), no_dist=True)
    nested: dict = {}
    for key, value in flat.items():
        *parents, last = metadata.planner_data[key]  # the item's place in the saved dicts
        container = nested
        for part in parents:
            container = container.setdefault(part, {})
        container[last] = value
    return {**checkpoint, **{part: _with_lists(nested[part]) for part in _parts(metadata)}}


def _with_lists(value):
    """Dicts keyed 0..n-1 back into the lists they were (an optimizer's param_groups)."""
    if not isinstance(value, dict):
        return value
    value = {k: _with_lists(v) for k, v in value.items()}
    if value and all(isinstance(k, int) for k in value):
        return [value[i] for i in sorted(value)]
    return value


def convert(source: Path, destination: Path) -> dict:
    """`ddptrain convert SRC DST`: a sharded checkpoint folder as one checkpoint file, which
    --resume, --evaluate and export take like any other. Returns the checkpoint."""
    if not source.is_dir():
        raise UserError(f"convert: {source} is not a sharded checkpoint folder")
    if destination.suffix != ".pt":
        raise UserError(f"convert: DST {destination} must end in .pt")
    if not destination.parent.is_dir():
        raise UserError(f"convert: DST {destination}: no directory {destination.parent}")
    if destination.parent.resolve().is_relative_to(source.resolve()):
        raise UserError(f"convert: DST {destination} lies inside SRC {source}; write it elsewhere")
    verify(source)
    checkpoint = to_single(source)
    files.atomic_write(destination, files.serialized(checkpoint))
    return checkpoint
