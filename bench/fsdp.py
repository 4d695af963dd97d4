"""fsdp against ddp on 2 ranks (torchrun, gloo, OMP_NUM_THREADS=1 each), side by side per model:
the model state a rank holds, its peak memory while training, samples/s, and the peak that
`ddptrain plan` predicted.

Each rank runs ddptrain's own pieces (distributed.init, precision, parallelize.wrap with the
strategy, the optimizer, step.Step and train_epoch) on uint8 batches preloaded in memory, fp32
(or --amp bf16), 4 images per rank. Memory is MemTracker's (torch.distributed._tools) count of
the tensors a rank holds, over its first training steps: step 1 ends creating the momentum, step
2 and later are alike (DDP's bucket rebuild, old and new buckets at once, comes before, as
ddptrain lays them out: the planner counts it). Model state: parameters, gradients and optimizer
state as the rank holds them after a step (under fsdp, the local shards of its DTensors).

    python -m bench.fsdp [--quick] [--per-rank-batch N] [--amp bf16] [--timm]

A larger per-rank batch gives each parameter moved more compute: the speed ratio at 4 images
is fsdp's worst case (results for another batch go to fsdp-bN.json, for bf16 to fsdp-bf16.json).
Under bf16 fsdp gathers its parameters in bf16, half the bytes of fp32's, while both strategies
reduce the gradients in fp32.
"""

import argparse
import json
import resource

import torch
import torch.distributed as dist
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.tensor import DTensor

from bench import common
from bench.bound import Preloaded, random_batches, train_epochs
from ddptrain.config import Config
from ddptrain.data.loaders import Data
from ddptrain.distributed.env import init_distributed, teardown_distributed
from ddptrain.errors import first_line
from ddptrain.model.build import build_model
from ddptrain.model.precision import DTYPES, run_precision
from ddptrain.parallel.parallelize import wrap
from ddptrain.tools.plan import PlanRequest, plan
from ddptrain.train.optim import build_optimizer
from ddptrain.train.step import Step

RANKS = 2
PER_RANK_BATCH = 4
CLASSES = 10
TRACKED_STEPS = 3  # 1: the momentum is made; 2 and 3: as every later step
MODELS = (("resnet50", 32), ("vit_b_16", 32))  # (arch, image size); ViT: patches of 16 px
QUICK_MODELS = (("resnet18", 32),)
TIMM_MODELS = (("timm:convnext_atto", 32), ("timm:vit_tiny_patch16_224", 32))
STATE_TARGET = 0.55  # fsdp / ddp model state per rank, at most
SPEED_TARGET = 0.85  # fsdp / ddp samples/s, at least
PLAN_TOLERANCE = 0.15  # planned / measured peak, within this of 1
MiB = 2**20


def local_bytes(t: torch.Tensor) -> int:
    """The bytes this rank holds of t: a DTensor's local shard, else the whole tensor."""
    t = t.to_local() if isinstance(t, DTensor) else t
    return t.numel() * t.element_size()


def model_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    params = list(model.parameters())
    state = {
        "params": sum(local_bytes(p) for p in params),
        "grads": sum(local_bytes(p.grad) for p in params if p.grad is not None),
        "optimizer": sum(
            local_bytes(v)
            for per_param in optimizer.state.values()
            for v in per_param.values()
            if isinstance(v, torch.Tensor)
        ),
    }
    return {**state, "total": sum(state.values())}


def max_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def step_peaks(step: Step, batches, precision, env, model, optimizer) -> tuple[list[int], str]:
    """Each step's peak of the tensors the rank holds (MemTracker), and how it was measured. If
    the tracker cannot follow the step, the growth of the process's peak RSS over all the steps
    instead (which counts the allocator's slack too)."""
    tracker, peaks = MemTracker(), []
    tracker.track_external(model, optimizer)
    rss = max_rss()
    for i, (images, target) in enumerate(batches):
        tracker.reset_mod_stats()  # it refuses a module called again otherwise
        try:
            with tracker:
                step(precision.inputs(images, env.device), target)
        except Exception as err:  # any failure of the tool: measure otherwise
            for images, target in batches[i + 1 :]:
                step(precision.inputs(images, env.device), target)
            return [max_rss() - rss], f"ru_maxrss growth (MemTracker failed: {first_line(err)})"
        peak = tracker.get_tracker_snapshot("peak")
        peaks.append(sum(per_device["Total"] for per_device in peak.values()))
    return peaks, "MemTracker"


def rank_main(
    arch: str, image_size: int, strategy: str, steps: int, per_rank_batch: int, amp: str
) -> None:
    """One rank, under torchrun: TRACKED_STEPS steps under the memory tracker, one more as
    warm-up, then `steps` timed steps; rank 0 prints every rank's figures."""
    config = Config(
        dummy=True, arch=arch, batch_size=per_rank_batch * RANKS, workers=0,
        image_size=image_size, amp=amp, device="cpu", lr=0.1 * per_rank_batch * RANKS / 256,
        print_freq=10**9, epochs=2, strategy=strategy,
    )  # fmt: skip
    env = init_distributed(config.launch, config.data.workers)
    try:
        count = max(TRACKED_STEPS, steps)
        batches = random_batches(count, per_rank_batch, image_size, CLASSES, seed=env.rank)
        model = build_model(arch, CLASSES, image_size, pretrained=False)
        precision = run_precision(config, model, env.device)
        blank = torch.zeros(2, 3, image_size, image_size, dtype=torch.uint8)
        example = precision.inputs(blank, env.device)  # as ddptrain lays out DDP's buckets
        place = lambda built: precision.place(built, env.device)  # noqa: E731
        # fsdp's MixedPrecisionPolicy from --amp, as run.py gives it: without it, fsdp would
        # gather fp32 parameters and autocast would cast them all again each step.
        amp_dtype = DTYPES[precision.amp]
        model = wrap(
            model, env, strategy=strategy, arch=arch, amp_dtype=amp_dtype, example=example,
            place=place,
        )  # fmt: skip
        optimizer, scheduler = build_optimizer(model, config.optim)
        step = Step(model, optimizer, precision)
        tracked = batches[:TRACKED_STEPS]
        peaks, method = step_peaks(step, tracked, precision, env, model, optimizer)
        state = model_state(model, optimizer)
        feed = Data(batches, Preloaded([1, steps]), [], 0, {})
        rates = train_epochs(config, env, feed, model, optimizer, scheduler, precision, 2)
        figures = {"state": state, "step_peaks": peaks, "method": method, "max_rss": max_rss()}
        every = [None] * env.world_size
        dist.all_gather_object(every, figures)
        if env.is_main:
            result = {
                "ranks": every,
                "samples_per_sec": rates[-1],
                "channels_last": precision.channels_last,
                "threads": torch.get_num_threads(),
            }
            print(json.dumps(result))
    finally:
        teardown_distributed()


def measure(
    arch: str, image_size: int, strategy: str, steps: int, per_rank_batch: int, amp: str
) -> dict:
    cmd = common.python(
        "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={RANKS}",
        "-m", "bench.fsdp", "--rank-main", "--arch", arch, "--image-size", str(image_size),
        "--strategy", strategy, "--steps", str(steps), "--per-rank-batch", str(per_rank_batch),
        "--amp", amp,
    )  # fmt: skip
    result = common.run_json(cmd, common.subprocess_env(OMP_NUM_THREADS="1"))
    assert result["threads"] == 1, result
    return result


def memory(runs: list[dict], planned: dict) -> dict:
    """A contender's memory figures: the largest rank's (they are the same in every run)."""
    ranks = [rank for run in runs for rank in run["ranks"]]
    peaks = [rank["step_peaks"] for rank in ranks]
    return {
        "model_state": max((r["state"] for r in ranks), key=lambda s: s["total"]),
        "peak": max(max(p) for p in peaks),
        "steady_peak": max(p[-1] for p in peaks),  # the last tracked step
        "step_peaks": peaks[0],
        "method": ranks[0]["method"],
        "max_rss": max(r["max_rss"] for r in ranks),
        "channels_last": runs[0]["channels_last"],
        "planned": {
            k: planned[k]
            for k in ("params", "grads", "optimizer", "activations", "step_peak", "peak")
        },
    }


def ratios_of(arch: str, ddp: dict, fsdp: dict) -> list[dict]:
    state = fsdp["model_state"]["total"] / ddp["model_state"]["total"]
    return [
        common.ratio_row(f"e. {arch}: fsdp / ddp model state per rank", state, STATE_TARGET, "<="),
        common.ratio_row(
            f"e. {arch}: fsdp / ddp samples/s", fsdp["median"] / ddp["median"], SPEED_TARGET
        ),
        common.ratio_row(f"e. {arch}: fsdp / ddp peak per rank", fsdp["peak"] / ddp["peak"], None),
        *(
            common.ratio_row(
                f"e. {arch} {r['strategy']}: planned / measured peak",
                r["planned"]["peak"] / r["peak"],
                PLAN_TOLERANCE,
                "within",
            )
            for r in (ddp, fsdp)
        ),
    ]


def print_memory(rows: list[dict]) -> None:
    print("\nPer rank, MiB: model state (params + grads + optimizer), peak, planned peak")
    header = f"  {'':<16}{'state':>8}{'params':>8}{'grads':>8}{'optim':>8}"
    print(f"{header}{'peak':>8}{'steady':>8}{'planned':>9}{'samples/s':>11}")
    for r in rows:
        s = r["model_state"]
        state = (s["total"], s["params"], s["grads"], s["optimizer"], r["peak"], r["steady_peak"])
        cells = "".join(f"{v / MiB:8.1f}" for v in state) + f"{r['planned']['peak'] / MiB:9.1f}"
        print(f"  {r['name']:<16}{cells}{r['median']:11.2f}")
    print(
        f"  (peak: of the first {TRACKED_STEPS} steps; steady: step {TRACKED_STEPS}, as every "
        f"later one; measured with {rows[0]['method']})"
    )


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke check")
    parser.add_argument(
        "--per-rank-batch", type=int, default=PER_RANK_BATCH, help="images per rank and step"
    )
    parser.add_argument(
        "--amp",
        choices=("none", "bf16"),
        default="none",
        help="precision of both strategies (fsdp: parameters gathered in it, gradients reduced "
        "in fp32; ddp: gradients all-reduced in fp32)",
    )
    parser.add_argument(
        "--timm",
        action="store_true",
        help="timm's models instead (convnext_atto, vit_tiny_patch16_224 at 32 px): results to "
        "fsdp-timm.json",
    )
    parser.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--arch", help=argparse.SUPPRESS)
    parser.add_argument("--image-size", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--strategy", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank_main:
        rank_main(
            args.arch, args.image_size, args.strategy, args.steps, args.per_rank_batch, args.amp
        )
        return {}
    s, batch = common.scale(args.quick), args.per_rank_batch
    models, steps = (QUICK_MODELS, 2) if args.quick else (TIMM_MODELS if args.timm else MODELS, 5)
    planned = {
        arch: plan(
            PlanRequest(
                arch,
                world_size=RANKS,
                batch_size=batch * RANKS,
                image_size=size,
                amp=args.amp,
                num_classes=CLASSES,
            )
        )  # fmt: skip
        for arch, size in models
    }
    details, contenders = {}, {}
    for arch, size in models:
        for strategy in ("ddp", "fsdp"):
            name = f"{arch} {strategy}"
            details[name] = []

            def contender(arch=arch, size=size, strategy=strategy, runs=details[name]) -> float:
                runs.append(measure(arch, size, strategy, steps, batch, args.amp))
                return runs[-1]["samples_per_sec"]

            contenders[name] = contender
    rows = common.compare(contenders, s, "samples/s")
    for row in rows:
        arch, strategy = row["name"].split()
        row.update(arch=arch, strategy=strategy)
        row.update(memory(details[row["name"]], planned[arch][strategy]))
    ratios = [
        r for i in range(0, len(rows), 2) for r in ratios_of(rows[i]["arch"], *rows[i : i + 2])
    ]
    settings = {
        "models": [{"arch": a, "image_size": size} for a, size in models],
        "ranks": RANKS,
        "per_rank_batch": batch,
        "num_classes": CLASSES,
        "amp": "none (fp32)" if args.amp == "none" else args.amp,
        "optimizer": "SGD momentum 0.9 (ddptrain's default)",
        "launcher": "torchrun --standalone, gloo, OMP_NUM_THREADS=1",
        "data": "uint8 batches preloaded in memory (no decoding)",
        "memory": f"{rows[0]['method']}, per rank, over the first {TRACKED_STEPS} steps; "
        "the largest rank's",
        "measured": f"samples/s of {steps} steps after {TRACKED_STEPS} tracked and 1 warm-up step",
        "planner": "ddptrain.tools.plan.plan (a traced step on fake tensors)",
        "repeats": s.repeats,
    }
    print_memory(rows)
    common.print_table("fsdp against ddp, 2 ranks (CPU, gloo)", rows, ratios)
    name = "fsdp" + ("" if batch == PER_RANK_BATCH else f"-b{batch}")
    name += "" if args.amp == "none" else f"-{args.amp}"
    name += "-timm" if args.timm else ""
    print(f"  -> {common.write_results(name, args.quick, settings, rows, ratios)}")
    return {"rows": rows, "ratios": ratios}


if __name__ == "__main__":
    main()
