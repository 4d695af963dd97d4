"""Data-parallel scaling on one machine: 2 ranks (torchrun, gloo, OMP_NUM_THREADS=1 each)
against 1 rank with 1 thread, same global batch, once per DDP gradient communication hook
(--ddp-comm-hook none, bf16, fp16, powersgd).

Each rank runs ddptrain's own pieces (distributed.init, the model, precision, DDP wrapping with
its ParallelSettings, trainer.train_epoch) on uint8 batches preloaded in memory, so data loading
is not what is measured: the figure is compute plus gradient all-reduce. resnet18 at 224 px,
--amp bf16 where the CPU has bf16 units, else fp32 (common.native_amp; --amp to choose).
Another contender runs the 2 ranks without DDP (no gradient all-reduce): what the two cores
give when nothing is communicated, the ceiling each 2-rank figure is set against.
After the repeats, two more 2-rank runs, hook none and the ceiling, are profiled
(torch.profiler, rank 0, the timed steps): where a 2-rank step's time goes, and what the
all-reduce adds to it.

    python -m bench.scaling [--quick]
"""

import argparse
import dataclasses
import json

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from bench import common
from bench.bound import Preloaded, random_batches, train_epochs
from ddptrain.config import Config, ParallelSettings
from ddptrain.data.loaders import Data
from ddptrain.distributed.env import init_distributed, teardown_distributed
from ddptrain.model.build import build_model
from ddptrain.model.precision import run_precision
from ddptrain.parallel.comm_hooks import HOOKS
from ddptrain.parallel.parallelize import wrap
from ddptrain.train.optim import build_optimizer

TARGET, STRETCH = 1.8, 1.9
CLASSES = 10
WARMUP_STEPS = 3
# PowerSGD runs from this synchronised step (the smallest it accepts), so inside the warm-up.
POWERSGD_START = 2
PROFILE_ROWS = 12


class TopOps:
    """torch.profiler over the timed epoch's steps (after the warm-up epoch's): .step() after
    each step; .table() the ops by self CPU time."""

    def __init__(self, warmup: int, steps: int):
        self._profiler = profile(
            activities=[ProfilerActivity.CPU],
            schedule=schedule(wait=warmup, warmup=0, active=steps, repeat=1),
        )
        self._profiler.start()

    def step(self) -> None:
        self._profiler.step()

    def table(self) -> list[dict]:
        self._profiler.stop()
        events = self._profiler.key_averages()
        total = sum(e.self_cpu_time_total for e in events) or 1
        top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:PROFILE_ROWS]
        return [
            {
                "op": e.key,
                "self_cpu_ms": round(e.self_cpu_time_total / 1000, 1),
                "share": round(e.self_cpu_time_total / total, 3),
                "calls": e.count,
            }
            for e in top
        ]


def rank_main(
    batch: int, image_size: int, steps: int, hook: str | None, amp: str, profiled: bool = False
) -> None:
    """One rank, under torchrun: a short warm-up epoch, then `steps` steps; rank 0 prints
    samples/s. `hook` None: the model is not wrapped in DDP."""
    config = Config(
        dummy=True, batch_size=batch, workers=0, image_size=image_size, amp=amp,
        device="cpu", lr=0.1 * batch / 256, print_freq=10**9, epochs=2,
    )  # fmt: skip
    env = init_distributed(config.launch, config.data.workers)
    try:
        per_rank = batch // env.world_size
        count = max(steps, WARMUP_STEPS)
        batches = random_batches(count, per_rank, image_size, CLASSES, seed=env.rank)
        model = build_model("resnet18", CLASSES, image_size, pretrained=False)
        precision = run_precision(config, model, env.device)
        model = precision.place(model, env.device)
        if hook is not None:
            comm = ParallelSettings(ddp_comm_hook=hook, powersgd_start_step=POWERSGD_START)
            model = wrap(model, env, gpu_pinned=False, comm=comm)
        optimizer, scheduler = build_optimizer(model, config.optim)
        feed = Data(batches, Preloaded([WARMUP_STEPS, steps]), [], 0, {})
        profiler = TopOps(WARMUP_STEPS, steps) if profiled and env.is_main else None
        parts = (config, env, feed, model, optimizer, scheduler, precision, 2, profiler)
        rates = train_epochs(*parts)
        if env.is_main:
            result = {"samples_per_sec": rates, "threads": torch.get_num_threads()}
            if profiler is not None:
                result["top_ops"] = profiler.table()
            print(json.dumps(result))
    finally:
        teardown_distributed()


def launch(
    ranks: int, s: common.Scale, steps: int, hook: str | None, amp: str, profiled=False
) -> dict:
    cmd = common.python(
        "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
        "-m", "bench.scaling", "--rank-main", "--batch", str(s.batch),
        "--image-size", str(s.image_size), "--steps", str(steps),
        "--hook", hook or "nosync", "--amp", amp, *(["--profiled"] if profiled else []),
    )  # fmt: skip
    result = common.run_json(cmd, common.subprocess_env(OMP_NUM_THREADS="1"))
    assert result["threads"] == 1, result
    return result


def measure(ranks: int, s: common.Scale, steps: int, amp: str, hook: str | None = "none") -> float:
    return launch(ranks, s, steps, hook, amp)["samples_per_sec"][-1]


def row_name(hook: str | None) -> str:
    return "2 ranks, no gradient sync (ceiling)" if hook is None else f"2 ranks, hook {hook}"


def print_profile(profiles: dict) -> None:
    for name, result in profiles.items():
        print(
            f"\n  profile, {name} (rank 0, {result['steps']} steps, self CPU time; "
            f"{result['samples_per_sec']:.1f} samples/s):"
        )
        for op in result["top_ops"]:
            print(
                f"    {op['op'][:48]:<48} {op['self_cpu_ms']:9.1f} ms  {100 * op['share']:5.1f}%"
                f"  ({op['calls']} calls)"
            )


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke check")
    parser.add_argument("--repeats", type=int, help="runs of each contender (default: the scale's)")
    parser.add_argument("--hooks", nargs="+", choices=HOOKS, default=list(HOOKS))
    parser.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--image-size", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--amp", choices=("none", "bf16"), help="default: common.native_amp")
    parser.add_argument("--hook", help=argparse.SUPPRESS)
    parser.add_argument("--profiled", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank_main:
        hook = None if args.hook == "nosync" else args.hook
        rank_main(args.batch, args.image_size, args.steps, hook, args.amp, args.profiled)
        return {}
    s = common.scale(args.quick)
    if args.repeats:
        s = dataclasses.replace(s, repeats=args.repeats)
    steps = 2 if args.quick else 5
    amp = args.amp or common.native_amp()
    contenders = {"1 rank, 1 thread": lambda: measure(1, s, steps, amp)}
    for hook in [*args.hooks, None]:
        contenders[row_name(hook)] = lambda hook=hook: measure(2, s, steps, amp, hook)
    rows = common.compare(contenders, s, "samples/s")
    ceiling = row_name(None)
    ratios = [
        common.paired_ratio(
            "d. ceiling: 2 ranks without sync / 1 rank",
            rows, lambda m: m[ceiling] / m["1 rank, 1 thread"], None,
        )
    ]  # fmt: skip
    for hook in args.hooks:
        name = row_name(hook)
        ratios += [
            common.paired_ratio(
                f"d. {hook}: 2 ranks / 1 rank",
                rows, lambda m, name=name: m[name] / m["1 rank, 1 thread"], TARGET,
                stretch=STRETCH,
            ),
            common.paired_ratio(
                f"d. {hook}: 2 ranks / ceiling",
                rows, lambda m, name=name: m[name] / m[ceiling], None,
            ),
        ]  # fmt: skip
    profiles = {}
    for hook in ("none", None):
        if s.tries > 1:
            common.wait_for_quiet()
        result = launch(2, s, steps, hook, amp, profiled=True)
        profiles[row_name(hook)] = {
            "steps": steps,
            "samples_per_sec": round(result["samples_per_sec"][-1], 2),
            "top_ops": result["top_ops"],
        }
    settings = {
        "arch": "resnet18",
        "amp": amp,
        "image_size": s.image_size,
        "global_batch": s.batch,
        "data": "uint8 batches preloaded in memory (no decoding)",
        "launcher": "torchrun --standalone, gloo, OMP_NUM_THREADS=1",
        "hooks": args.hooks,
        "powersgd": f"rank 1, from synchronised step {POWERSGD_START}, one bucket on gloo",
        "measured": f"{steps} steps after {WARMUP_STEPS} warm-up steps",
        "ratios": "median over repeats of each repeat's ratio (contenders side by side)",
        "repeats": s.repeats,
        "profiles": profiles,  # rank 0's self CPU time by op over the timed steps
    }
    common.print_table("Scaling, 2 ranks against 1 (CPU, gloo)", rows, ratios)
    print_profile(profiles)
    print(f"  -> {common.write_results('scaling', args.quick, settings, rows, ratios)}")
    return {"rows": rows, "ratios": ratios}


if __name__ == "__main__":
    main()
