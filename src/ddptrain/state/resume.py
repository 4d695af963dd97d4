"""What a run starts from, checked before anything is built: the out-dir it writes into and the
checkpoint it resumes (read, and fit to continue this run)."""

import json
import os
from collections.abc import Callable
from pathlib import Path

from ddptrain.config import Config, flag_name
from ddptrain.errors import UserError
from ddptrain.state import files, sharded
from ddptrain.state.files import (
    LATEST,
    global_step_of,
    holds_ema_weights,
    load,
    numbered,
    remove_stale_temp_files,
    resolve,
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
    _check_own_config(out_dir / "config.json")
    checkpoints = numbered(out_dir)
    # The best copies too: a run's checkpoints deleted to free room, its model_best stays, and
    # a fresh run would overwrite it (and its records) with its own.
    links_and_bests = [files.LATEST, sharded.LATEST, files.BEST, sharded.BEST]
    earlier = [p for p in [*checkpoints, *(out_dir / n for n in links_and_bests)] if p.exists()]
    continues = resume is not None and any(p.samefile(resume) for p in earlier)
    if earlier and not continues and earlier[0].name in (files.BEST, sharded.BEST):
        raise UserError(  # which --resume auto does not take (files.resolve)
            f"--out-dir {out_dir} holds {earlier[0].name} of an earlier run and no checkpoint: "
            "this run would overwrite it; move it away, or choose another --out-dir"
        )
    if earlier and not continues and auto:
        raise UserError(
            f"--resume auto: no usable checkpoint in --out-dir {out_dir} (see the warnings), "
            f"yet it holds {earlier[0].name} of an earlier run, which a fresh start would "
            "overwrite: move it away, or choose another --out-dir"
        )
    if earlier and not continues:
        raise UserError(
            f"--out-dir {out_dir} already holds {earlier[0].name} of an earlier run: continue "
            "it with --resume auto, or choose another --out-dir"
        )
    if continues and not auto:
        steps = [global_step_of(p) for p in checkpoints if p.samefile(resume)]
        later = [p.name for p in checkpoints if steps and global_step_of(p) > steps[0]]
        if later:  # going back here would leave them to outrank this run's own saves
            raise UserError(
                f"--resume {resume}: --out-dir {out_dir} holds later checkpoints of its run "
                f"({', '.join(later)}): resume it into another --out-dir, or move those away "
                "first"
            )


def find_resume(
    resume: str | None, out_dir: Path, evaluate: bool, skipped: Callable[[str], None]
) -> Path | None:
    """The checkpoint --resume names (files.resolve), once the leftovers of a crash are gone
    from the out-dir: a checkpoint folder a crash left set aside is back in its place before
    `auto` looks (not for --evaluate, which writes nothing). Rank 0, holding the out-dir's
    lock."""
    if not evaluate:
        remove_stale_temp_files(out_dir)
    return resolve(resume, out_dir, skipped)


def roll_back(out_dir: Path, global_step: int) -> list[Path]:
    """Makes the checkpoint of global_step, which this run resumed, the newest in out_dir
    again: `--resume auto` passed over later ones, found damaged (an earlier checkpoint named
    on purpose is refused while later ones exist: check_out_dir). Left there, they would
    outrank this run's saves, which are numbered by global step: in retention, which would
    delete a save as it is made. Removes them, and points each latest link that named one of
    them at the newest checkpoint of its format left (or removes it); returns what it removed.
    On the main rank, once every rank has set up: a run that fails to start removes
    nothing."""
    later = [path for path in numbered(out_dir) if global_step_of(path) > global_step]
    links = {sharded.SUFFIX: out_dir / sharded.LATEST, ".pt": out_dir / LATEST}
    stale = [s for s, link in links.items() if any(_names(link, p) for p in later)]
    for path in later:
        files.remove(path)
    for suffix in stale:
        newest = next((p for p in numbered(out_dir) if p.suffix == suffix), None)
        if newest is None:
            links[suffix].unlink(missing_ok=True)
        else:
            (sharded.link_latest if suffix == sharded.SUFFIX else files.link_latest)(newest)
    return later


def _names(link: Path, checkpoint: Path) -> bool:
    """Whether a latest link (checkpoint.pt, a hard link; checkpoint.dcp, a symlink) is that
    checkpoint."""
    try:
        return link.samefile(checkpoint)
    except OSError:
        return False


def load_resumed(path: Path) -> dict:
    # Mapped, not read: the ranks of a host share one copy in the page cache, and a rank reads
    # only the tensors it uses (under fsdp rank 0's weights are broadcast, the others' unread).
    try:
        return load(path, mmap=True)
    except UserError as err:
        raise UserError(f"--resume: {err}") from None


def _check_own_config(path: Path) -> None:
    """config.json is rewritten at every save: one another program left there (the out-dir
    may be the user's working directory) is refused, as a foreign metrics.jsonl is."""
    if not path.exists():
        return
    try:
        record = json.loads(path.read_bytes())
    except (OSError, ValueError):
        record = None
    if not (isinstance(record, dict) and "resolved" in record):
        raise UserError(
            f"--out-dir {path.parent}: {path.name} there is not ddptrain's (it has no "
            "'resolved' entry) and would be overwritten: move it away, or choose another --out-dir"
        )


def saved_data(path: Path) -> str | None:
    """The DATA of the run a checkpoint continues (its config's), read without its tensors, or
    None: it has none (the built-in data set), or the checkpoint cannot say, which its load
    proper then names."""
    source = path / sharded.STATE if path.is_dir() else path
    if not source.is_file():  # a FIFO would block the open for good: load refuses it
        return None
    try:
        config = files.safe_load(source, "ddptrain checkpoint", mmap=True)["config"]
        data = None if config.get("dummy") else config["data"]
    except Exception:  # noqa: BLE001 - whatever is wrong, load names it in its own words
        return None
    return data if isinstance(data, str) else None


def kept_seed(config: Config, saved: dict, on_command_line: frozenset[str]) -> str | None:
    """A line for a --seed given on the command line (`on_command_line`: config_layers.Layers)
    on resuming a run whose data seed differs: the run keeps its own, so that its sample order
    and augmentation continue exactly (and its random states come back from the checkpoint),
    whatever config.json then records as --seed."""
    data_seed, seed = saved.get("data_seed"), config.optim.seed
    if "seed" not in on_command_line or data_seed in (None, seed):
        return None
    return (
        f"--seed {seed} does not reseed a resumed run: it keeps its data seed "
        f"{data_seed} (sample order, augmentation) and its random states, to continue exactly"
    )


def check_position(saved: dict, config: Config) -> None:
    """A checkpoint taken mid-epoch continues the epoch's sample order at step x global batch:
    that position only exists for the same global batch."""
    saved_batch = saved.get("config", {}).get("batch_size")
    batch = config.optim.batch_size
    if saved.get("epoch_step") and saved_batch != batch:
        raise UserError(
            f"--batch-size {batch}: the checkpoint stopped mid-epoch with global "
            f"batch {saved_batch}; resume with -b {saved_batch} (any number of ranks)"
        )


# The settings a schedule's saved state holds (train/schedule.py): given anew on resume, they
# would be overwritten by the load without a word (a cosine stretched by --epochs would rise
# again after its old end). --lr is not among them: a new one rescales the schedule under way.
SCHEDULE_SHAPE = {
    "step": ("lr_step_size", "lr_gamma"),
    "multistep": ("lr_milestones", "lr_gamma"),
    "cosine": ("epochs", "lr_min"),
    "none": (),
}
WARMUP_SHAPE = ("lr_warmup_epochs", "lr_warmup_decay")


def check_continuable(saved: dict, config: Config, path: Path) -> None:
    """The saved optimizer and schedule states continue only as they were saved: another
    optimizer or --lr-scheduler, or a warmup added or dropped, would fail inside the load, and
    a flag that shapes the schedule would be undone by it. So would another -b under a
    schedule or a warmup, which count optimizer steps of the batch they were made for (a step
    schedule's drop would come an epoch late, a cosine rise again), and the weight decay of
    norms given or dropped: the optimizer's parameter groups would differ from the saved ones,
    which load into them without a word, and train the weights at another LR than the
    schedule's. --layer-decay and --head-lr-scale make the groups too."""
    was, optim = saved.get("config") or {}, config.optim  # the names: optim's settings
    names = ["opt", "lr_scheduler", "norm_weight_decay", "layer_decay", "head_lr_scale"]
    names += SCHEDULE_SHAPE.get(optim.lr_scheduler, ())
    warmup = optim.lr_warmup_epochs > 0 or was.get("lr_warmup_epochs", 0) > 0
    if warmup:
        names += WARMUP_SHAPE
    if optim.lr_scheduler != "none" or warmup:
        names.append("batch_size")

    def differs(name: str) -> bool:
        before, now = was[name], getattr(optim, name)
        if name == "opt":  # sgd-nesterov has sgd's state; optim.keep_given sets its nesterov
            return before.removesuffix("-nesterov") != now.removesuffix("-nesterov")
        if name == "norm_weight_decay":  # another value keeps the groups (optim.keep_given)
            return (before is None) != (now is None)
        return _shown(before) != _shown(now)

    def given(name: str) -> str:
        now = getattr(optim, name)
        return f"no {flag_name(name)}" if now is None else f"{flag_name(name)} {_shown(now)}"

    def trained(name: str) -> str:
        return "without it" if was[name] is None else f"with {_shown(was[name])}"

    differing = [name for name in names if name in was and differs(name)]
    changed = [f"{given(name)} (trained {trained(name)})" for name in differing]
    if changed:
        raise UserError(
            f"--resume: {path} cannot continue under {'; '.join(changed)}: its optimizer and "
            f"schedule go on as they were; to change them, start a new run from its weights "
            f"with --pretrained {_weights_file(path)}"
        )


def check_same_leave_out(given: Config, merged: Config, path: Path) -> None:
    """The images --bad-images skip leaves out are found on every rank before the checkpoint
    is read, with the flags given: the checkpoint's own --bad-images skip, or the
    --max-image-pixels that made an image bad, comes too late, and the resumed run read as
    trained on other data ("trained on 8 train images, and DATA has 9 now")."""
    data = merged.data
    if data.bad_images != "skip" or data.root is None or data.dummy:
        return  # nothing is left out: the loaders take the checkpoint's settings
    for name in ("bad_images", "max_image_pixels"):
        was = getattr(data, name)
        if was != getattr(given.data, name):
            raise UserError(
                f"--resume: {path} was trained with {flag_name(name)} {was}: give it again, "
                "so that the same images are left out"
            )


def _weights_file(path: Path) -> str:
    """What --pretrained takes for a checkpoint: a sharded folder is converted first."""
    if path.is_dir():
        return f"FILE.pt, made by `ddptrain convert {path} FILE.pt`"
    return str(path)


def _shown(value) -> str:
    """A setting as a flag gives it: 1 and 1.0 alike, a list as its items."""
    if isinstance(value, (list, tuple)):
        return " ".join(map(_shown, value))
    return f"{value:g}" if isinstance(value, float) else str(value)


def check_trainable(saved: dict, path: Path) -> None:
    """A model_best.pt whose model is the EMA (files.best_copy) evaluates, but cannot go on
    training: the raw weights it averaged are in the numbered checkpoint of its step."""
    if holds_ema_weights(saved):
        raw = f"checkpoint-{saved['global_step']:09d}{'.dcp' if path.is_dir() else '.pt'}"
        raise UserError(
            f"--resume: {path} holds the EMA of the weights as its model (the average scored "
            f"best): evaluate it with --evaluate, or resume training from {raw}"
        )
