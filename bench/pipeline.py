"""Data pipeline throughput per core: 1 process, 0 loader workers, 1 thread, one epoch of the
generated JPEG set through each train pipeline, timed in process CPU time.

  classic:   torchvision ImageFolder (PIL) -> RandomResizedCrop, flip, ToTensor, Normalize
  ddptrain:  its train loader (TorchCodec decode -> v2 crop and flip on uint8), which
             yields uint8 batches; normalisation happens on the training device
  ddptrain + normalise: the same, then Precision.inputs on the CPU (channels_last float32),
             for a like-for-like end product

    python -m bench.pipeline [--quick]
"""

import argparse
import dataclasses
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader
from torchvision import datasets, transforms

from bench import common
from ddptrain.config import Config
from ddptrain.data.loaders import build_data
from ddptrain.data.sources import open_source
from ddptrain.data.transforms import MEAN, STD
from ddptrain.distributed.env import DistEnv
from ddptrain.model.precision import Precision

TARGET = 1.8
CPU = torch.device("cpu")


def classic_loader(root: Path, s: common.Scale) -> DataLoader:
    preset = transforms.Compose(
        [
            transforms.RandomResizedCrop(s.image_size),
            transforms.RandomHorizontalFlip(),
            transforms.ToTensor(),
            transforms.Normalize(MEAN, STD),
        ]
    )
    train = datasets.ImageFolder(str(root / "train"), preset)
    return DataLoader(train, batch_size=s.batch, shuffle=True, num_workers=0)


def ddptrain_loader(root: Path, s: common.Scale) -> DataLoader:
    config = Config(data=str(root), batch_size=s.batch, workers=0, image_size=s.image_size)
    env = DistEnv(rank=0, world_size=1, local_rank=0, local_world_size=1, device=CPU)
    return build_data(config, env, open_source(config), seed=0).train_loader


def images_per_sec(loader: DataLoader, finish=lambda images: images, passes: int = 2) -> float:
    """Images per second of this process's CPU time over `passes` epochs: per core, and less
    moved by other work on the machine than wall time (it is all one thread here)."""
    start, count = time.process_time(), 0
    for _ in range(passes):
        for images, _ in loader:
            finish(images)
            count += len(images)
    return count / (time.process_time() - start)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke check")
    quick = parser.parse_args(argv).quick
    s = common.scale(quick)
    root = common.jpeg_folder(s)
    torch.set_num_threads(1)
    precision = Precision("cpu", channels_last=True)
    contenders = {
        "classic (PIL, float batches)": lambda: images_per_sec(classic_loader(root, s)),
        "ddptrain (uint8 batches)": lambda: images_per_sec(ddptrain_loader(root, s)),
        "ddptrain + normalise on CPU": lambda: images_per_sec(
            ddptrain_loader(root, s), lambda images: precision.inputs(images, CPU)
        ),
    }
    for measure in contenders.values():  # warm-up: page cache, first-call costs
        measure()
    if not quick:
        s = dataclasses.replace(s, repeats=5)  # runs are short and cheap: 5 steady the medians
    rows = common.compare(contenders, s, "images/s")
    m = [r["median"] for r in rows]
    ratios = [
        common.ratio_row("c. ddptrain / classic, per core", m[1] / m[0], TARGET),
        common.ratio_row("c. ddptrain incl. normalise / classic", m[2] / m[0], TARGET),
    ]
    settings = {
        "processes": 1,
        "workers": 0,
        "threads": 1,
        "batch": s.batch,
        "image_size": s.image_size,
        "train_images": s.classes * s.train_per_class,
        "source_images": f"{s.width}x{s.height} JPEG q90",
        "repeats": s.repeats,
        "timed": "process CPU time, 2 passes over the set per run",
    }
    common.print_table("Data pipeline, images/s per core", rows, ratios)
    print(f"  -> {common.write_results('pipeline', quick, settings, rows, ratios)}")
    return {"rows": rows, "ratios": ratios}


if __name__ == "__main__":
    main()
