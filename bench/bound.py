"""ddptrain's compute bound: its own training loop (trainer.train_epoch, with the CLI's thread
rule, precision and model) fed from batches preloaded in memory instead of the loader.

    python -m bench.bound DATA -b 32 -j 2 --amp bf16 --epochs 2

prints a JSON line: samples/s of each epoch, and the cores the process kept busy in each.
"""

import argparse
import itertools
import json
import resource
import time

import torch

from bench import common
from ddptrain.config import Config
from ddptrain.data.loaders import Data, build_data
from ddptrain.data.sources import open_source
from ddptrain.distributed.env import init_distributed
from ddptrain.model.build import build_model
from ddptrain.model.precision import run_precision
from ddptrain.report.reporter import Reporter
from ddptrain.state.checkpointer import TrainState
from ddptrain.train.optim import build_optimizer
from ddptrain.train.preempt import StopRequests
from ddptrain.train.trainer import Run, train_epoch


class Preloaded:
    """The sampler's part train_epoch uses, over a list of preloaded batches: `steps[e]` of
    them in epoch e."""

    def __init__(self, steps: list[int]):
        self.steps_by_epoch, self.steps = steps, steps[0]

    def set_epoch(self, epoch: int, start_step: int = 0) -> None:
        self.steps = self.steps_by_epoch[epoch]


def random_batches(
    count: int, per_rank: int, image_size: int, classes: int, seed: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`count` batches of random uint8 images and labels, as the train loader yields them (the
    trainer normalises them on the device)."""
    generator = torch.Generator().manual_seed(seed)
    shape = (per_rank, 3, image_size, image_size)
    return [
        (
            torch.randint(0, 256, shape, dtype=torch.uint8, generator=generator),
            torch.randint(0, classes, (per_rank,), generator=generator),
        )
        for _ in range(count)
    ]


def train_epochs(
    config,
    env,
    feed,
    model,
    optimizer,
    scheduler,
    precision,
    epochs: int,
    profiler=None,
    cores: list[float] | None = None,
) -> list[float]:
    """samples/s of each of `epochs` epochs of trainer.train_epoch: nothing shown, recorded or
    saved, so only the training steps are timed. `profiler.step()`, if given, after each step.
    `cores`, if given, receives the cores this process kept busy in each epoch."""
    quiet = Reporter(env, None, "none")
    rates = []
    with StopRequests(env) as stop:
        parts = (config, env, feed, model, optimizer, scheduler, quiet, 0, precision, None)
        run = Run(*parts, stop, profiler=profiler)
        for e in range(epochs):
            cpu, wall = common.cpu_seconds(resource.RUSAGE_SELF), time.perf_counter()
            rates.append(train_epoch(run, e, TrainState(epoch=e))["samples_per_sec"])
            if cores is not None:
                cores.append(
                    (common.cpu_seconds(resource.RUSAGE_SELF) - cpu) / (time.perf_counter() - wall)
                )
    return rates


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("data")
    parser.add_argument("-a", "--arch", default="resnet18")
    parser.add_argument("-b", "--batch-size", type=int, default=32)
    parser.add_argument("-j", "--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--amp", default="none")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()

    config = Config(
        data=args.data,
        arch=args.arch,
        batch_size=args.batch_size,
        workers=args.workers,
        epochs=args.epochs,
        image_size=args.image_size,
        amp=args.amp,
        lr=args.lr,
        device=args.device,
        print_freq=10**9,
    )
    # the thread count the CLI would choose, workers counted
    env = init_distributed(config.launch, config.data.workers)
    # The batches one epoch of the real loader yields, decoded up front.
    loaders = build_data(config.replace(workers=0), env, open_source(config), seed=0)
    steps = loaders.train_sampler.steps
    batches = list(itertools.islice(loaders.train_loader, steps))
    model = build_model(
        config.model.arch, loaders.num_classes, config.data.image_size, pretrained=False
    )
    precision = run_precision(config, model, env.device)
    model = precision.place(model, env.device)
    optimizer, scheduler = build_optimizer(model, config.optim)
    feed = Data(batches, Preloaded([steps] * args.epochs), [], 0, loaders.class_to_idx)
    cores: list[float] = []
    parts = (config, env, feed, model, optimizer, scheduler, precision, args.epochs)
    rates = train_epochs(*parts, cores=cores)
    print(
        json.dumps({"samples_per_sec": rates, "cores": cores, "threads": torch.get_num_threads()})
    )


if __name__ == "__main__":
    main()
