"""What a run starts from, checked before anything is built: the out-dir it writes into and the
checkpoint it resumes (read, and fit to continue this run)."""

import os
from pathlib import Path

from ddptrain.config import Config
from ddptrain.errors import UserError
from ddptrain.state import files, sharded
from ddptrain.state.files import (
    LATEST,
    global_step_of,
    holds_ema_weights,
    load,
    numbered,
    remove_stale_temp_files,
)


def check_out_dir(out_dir: Path, resume: Path | None, evaluate: bool, auto: bool) -> None:
    """A writable out-dir, holding no checkpoint but the one this run continues."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UserError(f"--out-dir {out_dir}: {err.strerror}") from None
    if not os.access(out_dir, os.W_OK):
        raise UserError(f"--out-dir {out_dir} is not writable")
    if evaluate:
        return
    remove_stale_temp_files(out_dir)
    earlier = [out_dir / LATEST, *numbered(out_dir)]
    earlier = [p for p in earlier if p.exists()]
    continues = resume is not None and any(p.samefile(resume) for p in earlier)
    if earlier and not continues and auto:
        raise UserError(
            f"--resume auto: no usable checkpoint in --out-dir {out_dir} (see the warnings), "
            f"yet it holds {earlier[0].name}: move the unusable files away, or choose another "
            "--out-dir"
        )
    if earlier and not continues:
        raise UserError(
            f"--out-dir {out_dir} already holds {earlier[0].name} of an earlier run: continue "
            "it with --resume auto, or choose another --out-dir"
        )


def roll_back(out_dir: Path, global_step: int) -> list[Path]:
    """Makes the checkpoint of global_step, which this run resumed, the newest in out_dir again:
    those of later steps belong to the run it went back from, as do their metrics records
    (Reporter.keep_until). Left there, they would outrank this run's saves, which are numbered
    by global step: --resume auto would pick them, and retention would delete a save as it is
    made. Removes them and points the latest link back at the one resumed; returns what it
    removed. On the main rank, once every rank has set up: a run that fails to start removes
    nothing."""
    later = [path for path in numbered(out_dir) if global_step_of(path) > global_step]
    for path in later:
        files.remove(path)
    if later:
        for path in numbered(out_dir):
            if global_step_of(path) == global_step:
                (sharded.link_latest if path.suffix == sharded.SUFFIX else files.link_latest)(path)
    return later


def load_resumed(path: Path) -> dict:
    # Mapped, not read: the ranks of a host share one copy in the page cache, and a rank reads
    # only the tensors it uses (under fsdp rank 0's weights are broadcast, the others' unread).
    try:
        return load(path, mmap=True)
    except UserError as err:
        raise UserError(f"--resume: {err}") from None


def check_position(saved: dict, config: Config) -> None:
    """A checkpoint taken mid-epoch continues the epoch's sample order at step x global batch:
    that position only exists for the same global batch."""
    saved_batch = saved.get("config", {}).get("batch_size")
    if saved.get("epoch_step") and saved_batch != config.batch_size:
        raise UserError(
            f"--batch-size {config.batch_size}: the checkpoint stopped mid-epoch with global "
            f"batch {saved_batch}; resume with -b {saved_batch} (any number of ranks)"
        )


def check_trainable(saved: dict, path: Path) -> None:
    """A model_best.pt whose model is the EMA (files.best_copy) evaluates, but cannot go on
    training: the raw weights it averaged are in the numbered checkpoint of its step."""
    if holds_ema_weights(saved):
        raw = f"checkpoint-{saved['global_step']:09d}{'.dcp' if path.is_dir() else '.pt'}"
        raise UserError(
            f"--resume: {path} holds the EMA of the weights as its model (the average scored "
            f"best): evaluate it with --evaluate, or resume training from {raw}"
        )
