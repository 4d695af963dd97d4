"""Resume on the data a checkpoint was trained on: its image counts and file lists must match.

A checkpoint records, per split, the image count and a digest of the sorted file list with
labels (`Data.facts`), and a packed set's shard sizes. Resumed on other data, a run would
continue a data order that no longer exists: a shrunk set would even leave a mid-epoch position
past the epoch's end. Checkpoints written before these facts existed resume unchecked, but for
that position.
"""

from pathlib import Path

from ddptrain.errors import UserError


def check_same_data(saved: dict, data_facts: dict, path: Path) -> None:
    """Raises UserError, one line saying what changed, when the data is not the checkpoint's.
    `saved` is the checkpoint (its `data_facts` and `epoch_step`), `data_facts` the data's now."""
    recorded = saved.get("data_facts") or {}
    for split, now in data_facts.items():
        then = recorded.get(split)
        if then is None:
            continue
        if then["images"] != now["images"]:
            raise UserError(
                f"--resume: {path} was trained on {then['images']} {split} images, and DATA "
                f"has {now['images']} now: resume on the same data, or start afresh in "
                "another --out-dir"
            )
        if None not in (then.get("digest"), now.get("digest")) and then["digest"] != now["digest"]:
            raise UserError(
                f"--resume: DATA has as many {split} images as {path} was trained on "
                f"({now['images']}), but other files (renamed, replaced or moved between "
                "classes): resume on the same data, or start afresh in another --out-dir"
            )
        _check_shards(then.get("shards"), now.get("shards"), split, path)
    _check_position(saved, data_facts, path)


def _check_shards(then: dict | None, now: dict | None, split: str, path: Path) -> None:
    """A packed set's shards, by size: the same images packed again (another --max-side, a
    shard replaced) keep their names and count. A checkpoint of a folder resumes on the set
    packed from it (neither has the other's shards to compare)."""
    if not then or not now:
        return
    for shard in sorted(then.keys() | now.keys()):
        was, size = then.get(shard), now.get(shard)
        if was != size:
            if was is None:
                change = "it was not in the data trained on"
            elif size is None:
                change = f"it had {was} bytes and is gone now"
            else:
                change = f"it had {was} bytes and has {size} now"
            raise UserError(
                f"--resume: DATA's {split} shard {shard} changed since {path} was trained "
                f"({change}; packed again, or replaced): resume on the same data, or start "
                "afresh in another --out-dir"
            )


def _check_position(saved: dict, data_facts: dict, path: Path) -> None:
    """A mid-epoch checkpoint continues at step epoch_step of the epoch: the data must still
    have that many steps (the global batch is the checkpoint's: run.py checks that)."""
    step = int(saved.get("epoch_step", 0))
    batch = saved.get("config", {}).get("batch_size")
    images = data_facts.get("train", {}).get("images")
    steps = None if not (step and batch and images is not None) else images // batch
    if steps is not None and steps < step:
        raise UserError(
            f"--resume: {path} stopped at step {step} of an epoch, and an epoch of DATA's "
            f"{images} train images has only {steps} step{'' if steps == 1 else 's'} of -b "
            f"{batch}: resume on the data it was trained on"
        )
