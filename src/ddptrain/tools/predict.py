"""`ddptrain predict MODEL INPUT... --out FILE`: the top-k classes of every input image.

Inputs are image files, folders (walked for image files, in sorted order) and the data sets
that train takes as DATA besides folders (a packed set on a disk or at a URL, a table set:
data/sources.py; their splits in order, each in the order training reads it). They are listed
alike on every rank and cut into contiguous shards (data/sampler.py `shard`: each input exactly
once, no padding); each rank runs its shard through the model with the val transform it was
evaluated with, and rank 0 gathers the rows in input order and writes them
(tools/prediction_files.py). No collective runs between batches, so the model runs unwrapped
and the last batch may be short.
"""

import contextlib
import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset, Subset

from ddptrain.config import MAX_IMAGE_PIXELS, Config, LaunchSettings
from ddptrain.data import fork_server
from ddptrain.data.folder import EXTENSIONS, image_problem, load_rgb
from ddptrain.data.remote import Remote, is_url
from ddptrain.data.sampler import shard
from ddptrain.data.shard_index import INDEX
from ddptrain.data.sources import packed_at_url, source_at
from ddptrain.data.split import SPLITS
from ddptrain.data.strings import Strings
from ddptrain.data.tables import is_table_set
from ddptrain.data.workers import Loader
from ddptrain.distributed.collectives import agree, check_same, gather_objects
from ddptrain.distributed.env import DistEnv, init_distributed, teardown_distributed
from ddptrain.errors import UserError, first_line
from ddptrain.model.precision import Precision
from ddptrain.tools import prediction_files
from ddptrain.tools.inference import Trained, load_trained

BAD_IMAGES = ("column", "error")


@dataclass(frozen=True)
class PredictRequest:
    model: Path
    inputs: list[str]
    out: Path
    topk: int | None = None  # None: 5, or every class of a model with fewer
    batch_size: int = 256  # global, as train's -b
    workers: int = 4  # per rank
    ema: bool = False
    bad_images: str = "column"
    max_image_pixels: int = MAX_IMAGE_PIXELS
    launch: LaunchSettings = field(default_factory=LaunchSettings)


def predict(request: PredictRequest, say, counting) -> str | None:
    """Runs on this process, one of any launcher's ranks; returns the line rank 0 shows (None
    on the other ranks). say, counting: report/progress.py's, for rank 0's warnings and bar."""
    if request.workers > 0:
        fork_server.start()  # it imports what loader workers need meanwhile
    env = init_distributed(request.launch, request.workers, None, say)
    try:
        return _predict(request, env, say, counting)
    finally:
        teardown_distributed()


def _predict(request: PredictRequest, env: DistEnv, say, counting) -> str | None:
    # Before anything slow: a bad --out ends the run at once, on every rank.
    agree(env, lambda: prediction_files.check(request.out) if env.is_main else None)
    Config(batch_size=request.batch_size).check_batch_divides(env.world_size)
    inputs = agree(env, lambda: list_inputs(request.inputs, request.max_image_pixels, say))
    paths = inputs.paths
    trained = agree(env, lambda: load_trained(request.model, request.ema))
    topk = agree(env, lambda: _topk(request.topk, len(trained.classes)))
    listed = hashlib.sha256("\0".join(paths).encode(errors="surrogateescape")).hexdigest()
    check_same(env, {"inputs": (len(paths), listed)}, "every node must see the same inputs")
    mine = shard(len(paths), env.rank, env.world_size)
    rows = agree(
        env,
        lambda: _predict_shard(trained, inputs, mine, request, topk, env, counting),
        doing="predicting",
    )
    shards = gather_objects(rows, env)
    if env.is_main:
        rows = [row for part in shards for row in part]  # contiguous shards: input order
    agree(env, lambda: prediction_files.write(request.out, rows, topk) if env.is_main else None)
    if not env.is_main:
        return None
    bad = sum(1 for row in rows if row.get("error"))
    note = f"; {bad} could not be read (their error column says why)" if bad else ""
    return f"wrote {request.out} ({len(paths)} images, top-{topk}{note})"


def _topk(asked: int | None, num_classes: int) -> int:
    if asked is None:
        return min(5, num_classes)
    if not 1 <= asked <= num_classes:
        raise UserError(f"--topk {asked}: the model has {num_classes} classes; give 1 to that")
    return asked


@dataclass
class Inputs:
    """The images to predict, in order: each as its row's `path` shows it, and where it is read
    from (`where`): a file, or a sample of one of `sets`. Compact (data/strings.py): each
    loader worker gets a copy."""

    paths: Sequence[str]
    sets: list[tuple[object, str]]  # (source, split)
    set_of: np.ndarray  # each input's data set's position in sets; -1: a file
    sample: np.ndarray  # its sample's position in that set's split

    def where(self, position: int) -> tuple[int, int] | None:
        """(data set, sample) of the input at position; None for a file."""
        found = int(self.set_of[position])
        return None if found < 0 else (found, int(self.sample[position]))


def list_inputs(inputs: list[str], max_pixels: int = MAX_IMAGE_PIXELS, say=None) -> Inputs:
    """Each input file as given; each folder's image files below it (hidden ones left out), as
    the folder joined with their path below it, in sorted order; each data set's samples, as
    the set joined with their name (`split/...`, as `ddptrain check` names them). `say` hears
    of a URL's failed requests being tried again."""
    paths, sets, set_of, sample = [], [], [], []
    for given in inputs:
        source = _data_set(given, max_pixels, say)
        if source is not None:
            named_index = given.endswith(".json")  # an index file's samples are beside it
            base = os.path.dirname(given) if named_index else given.rstrip("/")
            for split in (split for split in SPLITS if source.has(split)):
                names = source.names([split])
                paths += [os.path.join(base, name) for name in names]
                set_of += [len(sets)] * len(names)
                sample += range(len(names))
                sets.append((source, split))
            continue
        if os.path.isdir(given):
            below = _images_below(given)
            if not below:
                raise UserError(
                    f"INPUT {given} holds no image files (they end in {', '.join(EXTENSIONS)})"
                )
            found = [os.path.join(given, path) for path in below]
        elif os.path.exists(given):
            found = [given]
        else:
            raise UserError(f"INPUT {given} does not exist")
        paths += found
        set_of += [-1] * len(found)
        sample += [0] * len(found)
    arrays = np.array(set_of, dtype=np.int32), np.array(sample, dtype=np.int64)
    return Inputs(Strings(paths), sets, *arrays)


def _data_set(given: str, max_pixels: int, say=None):
    """The data source of a packed set (its folder or index file, on a disk or at a URL) or a
    table set; None for anything else, image folders included (walked as folders, which names
    their images alike)."""
    if is_url(given):
        return packed_at_url(Remote(given, say=say), max_pixels)
    root = Path(given)
    packed = (root / INDEX).is_file() or (root.suffix == ".json" and root.is_file())
    if packed or (root.is_dir() and is_table_set(root)):
        return source_at(root, max_pixels)
    return None


def _images_below(folder: str) -> list[str]:
    """Image files below folder, relative to it, sorted by their path's parts. Links are
    followed, each folder listed once (a link loop would walk forever)."""
    seen, found = set(), []
    for where, folders, names in os.walk(folder, followlinks=True):
        stat = os.stat(where)
        if (stat.st_dev, stat.st_ino) in seen:
            folders[:] = []
            continue
        seen.add((stat.st_dev, stat.st_ino))
        folders[:] = [name for name in folders if not name.startswith(".")]
        below = os.path.relpath(where, folder)
        for name in names:
            if not name.startswith(".") and name.lower().endswith(EXTENSIONS):
                found.append(os.path.normpath(os.path.join(below, name)))
    return sorted(found, key=lambda path: path.split(os.sep))


class InputImages(Dataset):
    """(uint8 image after the val transform, position, why it cannot be read or ""); an image
    that cannot be read is a blank one, or with stop_on_bad a UserError naming it. `splits`:
    the datasets of inputs.sets, transformed."""

    def __init__(
        self, inputs: Inputs, splits: list, transform, size: int, stop_on_bad: bool, max_pixels: int
    ):
        self.inputs, self.splits, self.transform, self.size = inputs, splits, transform, size
        self.stop_on_bad, self.max_pixels = stop_on_bad, max_pixels

    def __len__(self) -> int:
        return len(self.inputs.paths)

    def __getitem__(self, position: int):
        path, sample = self.inputs.paths[position], self.inputs.where(position)
        try:
            if sample is None:
                return self.transform(load_rgb(path, self.max_pixels)), position, ""
            image, _ = self.splits[sample[0]][sample[1]]
            return image, position, ""
        except UserError as err:
            # a file's problem alone; a data set's sample says it in its error's first line
            problem = (sample is None and image_problem(path, self.max_pixels)) or first_line(err)
        if self.stop_on_bad:
            raise UserError(
                f"predict: cannot read image {path}: {problem} (--bad-images column records "
                "it in an error column and goes on)"
            )
        return torch.zeros(3, self.size, self.size, dtype=torch.uint8), position, problem


@torch.no_grad()
def _predict_shard(
    trained: Trained,
    inputs: Inputs,
    mine: range,
    request: PredictRequest,
    topk: int,
    env: DistEnv,
    counting,
) -> list[dict]:
    """The rows of this rank's shard of the inputs, in order."""
    size, transform = trained.description["image_size"], trained.val_transform()
    splits = [source.split(split, transform).dataset for source, split in inputs.sets]
    images = InputImages(
        inputs,
        splits,
        transform,
        size,
        request.bad_images == "error",
        request.max_image_pixels,
    )
    loader = Loader(
        Subset(images, mine),
        request.batch_size // env.world_size,
        num_workers=request.workers,
        pin_memory=env.device.type == "cuda",
    )
    model = trained.model.to(env.device)
    # normalised as the model was trained (a timm model's weights may bring their own mean, std)
    d = trained.description
    precision = Precision(device_type=env.device.type, mean=tuple(d["mean"]), std=tuple(d["std"]))
    rows = []
    share = " (rank 0's share)" if env.world_size > 1 else ""
    progress = (
        counting(len(mine), f"predict{share}", "images")
        if env.is_main
        else contextlib.nullcontext(lambda n: None)
    )
    with progress as advance:
        for batch, positions, problems in loader:
            probabilities = model(precision.inputs(batch, env.device)).float().softmax(dim=1)
            top = probabilities.topk(topk, dim=1)
            rows += _rows(inputs.paths, positions, problems, top, trained.classes)
            advance(len(positions))
    return rows


def _rows(paths, positions, problems, top, classes: list[str]) -> list[dict]:
    rows = []
    values, indices = top.values.cpu().tolist(), top.indices.cpu().tolist()
    for position, problem, probs, picked in zip(
        positions.tolist(), problems, values, indices, strict=True
    ):
        row: dict = {"path": paths[position]}
        if problem:
            row["error"] = problem
        else:
            for rank, (prob, index) in enumerate(zip(probs, picked, strict=True), 1):
                row[f"top{rank}"], row[f"prob{rank}"] = classes[index], prob
        rows.append(row)
    return rows
