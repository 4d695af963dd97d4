"""Data-parallel scaling on one machine: 2 ranks (torchrun, gloo, OMP_NUM_THREADS=1 each)
against 1 rank with 1 thread, same global batch.

Each rank runs ddptrain's own pieces (distributed.init, the model, precision, DDP wrapping,
trainer.train_epoch) on uint8 batches preloaded in memory, so data loading is not what is
measured: the figure is compute plus gradient all-reduce. resnet18 at 224 px, --amp bf16.
A third contender runs the 2 ranks without DDP (no gradient all-reduce): what the two cores
give when nothing is communicated, the ceiling for the 2-rank figure.

    python -m bench.scaling [--quick]
"""

import argparse
import json

import torch

from bench import common
from bench.bound import Preloaded, random_batches, train_epochs
from ddptrain.config import Config
from ddptrain.data.loaders import Data
from ddptrain.dist.env import init_distributed, teardown_distributed
from ddptrain.model.build import build_model
from ddptrain.model.parallelize import wrap
from ddptrain.model.precision import resolve_precision
from ddptrain.train.optim import build_optimizer

TARGET = 1.9
CLASSES = 10


WARMUP_STEPS = 3


def rank_main(batch: int, image_size: int, steps: int, sync: bool) -> None:
    """One rank, under torchrun: a short warm-up epoch, then `steps` steps; rank 0 prints
    samples/s. Without `sync`, the model is not wrapped in DDP."""
    config = Config(
        dummy=True, batch_size=batch, workers=0, image_size=image_size, amp="bf16",
        device="cpu", lr=0.1 * batch / 256, print_freq=10**9, epochs=2,
    )  # fmt: skip
    env = init_distributed(config)
    try:
        per_rank = batch // env.world_size
        count = max(steps, WARMUP_STEPS)
        batches = random_batches(count, per_rank, image_size, CLASSES, seed=env.rank)
        model = build_model("resnet18", CLASSES, image_size, pretrained=False)
        precision = resolve_precision(config, None, model, env.device)
        model = precision.place(model, env.device)
        if sync:
            model = wrap(model, env, gpu_pinned=False)
        optimizer, scheduler = build_optimizer(model, config)
        feed = Data(batches, Preloaded([WARMUP_STEPS, steps]), [], 0, {})
        rates = train_epochs(config, env, feed, model, optimizer, scheduler, precision, 2)
        if env.is_main:
            print(json.dumps({"samples_per_sec": rates, "threads": torch.get_num_threads()}))
    finally:
        teardown_distributed()


def measure(ranks: int, s: common.Scale, steps: int, sync: bool = True) -> float:
    cmd = common.python(
        "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
        "-m", "bench.scaling", "--rank-main", "--batch", str(s.batch),
        "--image-size", str(s.image_size), "--steps", str(steps), *([] if sync else ["--no-sync"]),
    )  # fmt: skip
    result = common.run_json(cmd, common.subprocess_env(OMP_NUM_THREADS="1"))
    assert result["threads"] == 1, result
    return result["samples_per_sec"][-1]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke check")
    parser.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--image-size", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--no-sync", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank_main:
        rank_main(args.batch, args.image_size, args.steps, sync=not args.no_sync)
        return {}
    s = common.scale(args.quick)
    steps = 2 if args.quick else 5
    contenders = {
        "1 rank, 1 thread": lambda: measure(1, s, steps),
        "2 ranks, 1 thread each": lambda: measure(2, s, steps),
        "2 ranks, no gradient sync (ceiling)": lambda: measure(2, s, steps, sync=False),
    }
    rows = common.compare(contenders, s, "samples/s")
    one, two, ceiling = (r["median"] for r in rows)
    ratios = [
        common.ratio_row("d. 2 ranks / 1 rank", two / one, TARGET),
        common.ratio_row("d. ceiling: 2 ranks without sync / 1 rank", ceiling / one, None),
    ]
    settings = {
        "arch": "resnet18",
        "amp": "bf16",
        "image_size": s.image_size,
        "global_batch": s.batch,
        "data": "uint8 batches preloaded in memory (no decoding)",
        "launcher": "torchrun --standalone, gloo, OMP_NUM_THREADS=1",
        "measured": f"{steps} steps after {WARMUP_STEPS} warm-up steps",
        "repeats": s.repeats,
    }
    common.print_table("Scaling, 2 ranks against 1 (CPU, gloo)", rows, ratios)
    print(f"  -> {common.write_results('scaling', args.quick, settings, rows, ratios)}")
    return {"rows": rows, "ratios": ratios}


if __name__ == "__main__":
    main()
