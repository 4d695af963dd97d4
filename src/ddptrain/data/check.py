"""Bad images: find every image of a data set that cannot be used, before training reaches it.

`ddptrain check DATA` decodes every image of train/ and val/ (a folder's files, or a packed or
table set's samples) once, with the decoder and the decompression-bomb limit training uses
(folder.load_rgb), in DataLoader worker processes (-j), and lists each bad file with the reason.

Before training, `--verify-images` (or `--bad-images skip`, which needs the list) runs the same
check spread over the ranks: every rank decodes every world_size-th file of the sorted list,
and the ranks gather what they found, so each holds the same sorted list of bad files; a rank
whose check fails ends every rank (`agree`). With `--bad-images error` a bad file then stops
every rank before the first step. With `skip`, every rank leaves the same files out of its
sample lists before any sampler or loader exists (build_data): the train permutation is one of
the good images, the val shards cover each good image once, and nothing downstream knows the
others existed. So the world-size invariance, exact evaluation (val `samples` is the number of
good val images) and bitwise resume hold as for a data set that never had them. A resumed run
checks again and must find the same files: the checkpoint's data facts (count and digest of
the good files) refuse it otherwise. Paths are relative to DATA, so nodes that mount it at
different places agree.

Nothing here prints: the caller hands in its terminal, `say(line, stderr=False)` and
`counting(total, what, unit)` (report.progress's), and by default nothing is shown.
"""

import contextlib
import hashlib
import os
from pathlib import Path

from torch.utils.data import Dataset

from ddptrain.config import Config
from ddptrain.data.remote import Remote, is_url
from ddptrain.data.sources import (
    SPLITS,
    Source,
    check_same_classes,
    open_source,
    packed_at_url,
    source_at,
)
from ddptrain.data.workers import Loader
from ddptrain.distributed.collectives import agree, check_same, gather_from_all
from ddptrain.distributed.env import DistEnv
from ddptrain.distributed.threads import usable_cores
from ddptrain.errors import UserError, first_line

CHUNK = 16  # images a worker decodes per message: keeps the pipe's overhead below a decode


def _quiet(line: str, stderr: bool = False) -> None:
    """The default `say`: other ranks, and callers with no terminal, show nothing."""


def _uncounted(total: int, what: str, unit: str):
    """The default `counting`: no bar."""
    return contextlib.nullcontext(lambda n: None)


class _Problems(Dataset):
    """Why each sample is bad, or None: decoding happens in the DataLoader's workers."""

    def __init__(self, source: Source, names: list[str]):
        self.source, self.names = source, names

    def __len__(self) -> int:
        return len(self.names)

    def __getitem__(self, index: int) -> str | None:
        try:
            return self.source.problem(self.names[index])
        except Exception as err:  # a checker reports every sample's failure, whatever it is
            return f"{type(err).__name__}: {first_line(err)}"


def find_bad(
    source: Source, names: list[str], workers: int, counting=_uncounted
) -> list[tuple[str, str]]:
    """(name, reason) for each of the source's samples `names` that cannot be used, in order,
    counted on the caller's `counting` bar as they are checked."""
    loader = Loader(
        _Problems(source, names), batch_size=CHUNK, num_workers=workers, collate_fn=list
    )
    bad = []
    with counting(len(names), "checking images", "img") as advance:
        for start, problems in zip(range(0, len(names), CHUNK), loader, strict=True):
            bad += [(names[start + i], p) for i, p in enumerate(problems) if p is not None]
            advance(len(problems))
    return bad


def check_command(
    data: str,
    workers: int | None,
    max_image_pixels: int,
    image_column: str = "image",
    label_column: str = "label",
    say=_quiet,
    counting=_uncounted,
) -> None:
    """`ddptrain check DATA`: says every bad image on stdout, then raises a UserError (exit 2)
    when there is one; else says that all decode."""
    if workers is not None and workers < 0:
        raise UserError(f"-j/--workers must be at least 0, got {workers}")
    if max_image_pixels < 1:
        raise UserError(f"--max-image-pixels must be at least 1, got {max_image_pixels}")
    if is_url(data):
        source = packed_at_url(Remote(data, say=say), max_image_pixels)
    else:
        source = source_at(Path(data), max_image_pixels, image_column, label_column)
    splits = [split for split in SPLITS if source.has(split)]
    files = source.names(splits, say)
    workers = usable_cores() if workers is None else workers
    bad = find_bad(source, files, workers, counting)
    for path, reason in bad:
        say(f"{source.shown(path)}: {reason}")
    if bad:
        raise UserError(
            f"{len(bad)} of {len(files)} images in {data} are bad ({_per_split(bad, files)}), "
            "listed above: fix or remove them, or train with --bad-images skip"
        )
    missing = [f"{split}/" for split in SPLITS if split not in splits]
    if missing:  # as training would refuse it, once its images are known to decode
        raise UserError(
            f"DATA: {data} has no {' or '.join(missing)}, which training needs; its "
            f"{len(files)} images decode ({_per_split(None, files)})"
        )
    check_same_classes(source.split("train"), source.split("val"))  # as training would refuse them
    say(f"all {len(files)} images in {data} decode ({_per_split(None, files)})")


def images_to_leave_out(
    config: Config, env: DistEnv, say=_quiet, counting=_uncounted
) -> frozenset[str]:
    """For --verify-images and --bad-images skip: the bad files of DATA (relative to it) that
    skip leaves out, the same on every rank; with error, a bad file stops every rank. Nothing
    to do for the built-in data set and --dummy. A collective: every rank calls it. Rank 0
    shows the bad files (stderr), its bar and the verdict (stdout) through say and counting."""
    if not config.data.checks_images or config.data.root is None or config.data.dummy:
        return frozenset()
    warn = say  # a URL's retries: said on the rank that makes them
    if not env.is_main:  # other ranks stay quiet
        say, counting = _quiet, _uncounted
    source = agree(env, lambda: open_source(config, warn=warn))
    root = source.root
    files = agree(env, lambda: source.names(("val",) if config.checkpoint.evaluate else SPLITS))
    listed = hashlib.sha256(os.fsencode("\n".join(files))).hexdigest()  # names need not be UTF-8
    check_same(env, {"image files": listed})  # else the ranks' shares would not cover them
    share = files[env.rank :: env.world_size]
    found = agree(
        env,
        lambda: find_bad(source, share, config.data.workers, counting),
    )
    bad = sorted(item for part in gather_from_all(env, found) for item in part)
    skip = config.data.bad_images == "skip"
    for path, reason in bad:
        what = "warning: --bad-images skip: leaving out" if skip else "bad image"
        say(f"{what} {source.shown(path)}: {reason}", stderr=True)
    if bad and not skip:
        raise UserError(
            f"--verify-images: {len(bad)} of {len(files)} images in {root} are bad "
            f"({_per_split(bad, files)}), listed above: fix or remove them, or pass "
            "--bad-images skip to train without them"
        )
    verdict = f"{len(bad)} bad images left out" if bad else "no bad image"
    say(f"checked {len(files)} images: {verdict} ({_per_split(bad, files)})")
    return frozenset(path for path, _ in bad)


def _per_split(bad: list[tuple[str, str]] | None, files: list[str]) -> str:
    """`1 of 24 train, 0 of 15 val` (bad of all, per split), or `24 train, 15 val` without bad."""
    counts = []
    for split in SPLITS:
        total = sum(f.startswith(f"{split}/") for f in files)
        if total and bad is None:
            counts.append(f"{total} {split}")
        elif total:
            counts.append(f"{sum(p.startswith(f'{split}/') for p, _ in bad)} of {total} {split}")
    return ", ".join(counts)
