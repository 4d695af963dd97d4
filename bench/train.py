"""End-to-end training throughput on a generated JPEG ImageFolder, side by side:

  a. ddptrain (its real CLI, on the CPU) against the classic example's loop (bench.classic),
     in fp32 (ddptrain's defaults, so channels_last) and with --amp bf16; each gain set
     against its ceiling measured in the same run: what ddptrain's step alone gains over the
     classic fp32 step on the same in-memory batches and threads (bench.step);
  b. ddptrain against its own compute bound (bench.bound: the same loop fed from memory).

bf16 runs where the CPU has bf16 units (common.native_amp; --amps to choose): elsewhere it is
emulated, slower than fp32. The compute bound is taken in the first of the amps.

So every target is a ratio to a ceiling measured on the same CPU, which means the same on any.

Every contender trains resnet18 at 224 px with the same global batch and loader workers on
the same cores, for 2 epochs; the figure is the second epoch's (the first warms up: worker
start, kernel selection). Repeats alternate between contenders; medians are reported.

    python -m bench.train [--quick]
"""

import argparse
import dataclasses
import json
import tempfile
from pathlib import Path

from bench import common

WORKERS = 2
# Each ddptrain end-to-end run's share of its measured epoch spent waiting for the loader
# (metrics.jsonl's data_wait): where end to end loses against the compute bound.
DATA_WAIT: dict[str, list[float]] = {}


def lr(s: common.Scale) -> str:
    """The classic example's 0.1 for 256 images, scaled to the batch: at 0.1 a batch of 32
    diverges, and denormal and infinite values slow every CPU kernel down several times."""
    return str(0.1 * s.batch / 256)


# a: the end-to-end gain over the classic loop at least 0.95 of the step-only gain;
# b: end to end at least 0.95 of the compute bound.
TARGETS = {"step": 0.95, "bound": 0.95}
STEPS = {True: 2, False: 10}  # timed steps of bench.step (--quick, full), after its warm-up


def ddptrain(root: Path, s: common.Scale, amp: str) -> float:
    with tempfile.TemporaryDirectory() as out:
        common.run(
            common.python(
                "-m", "ddptrain", "train", str(root), "-a", "resnet18", "-b", str(s.batch),
                "-j", str(WORKERS), "--epochs", "2", "--image-size", str(s.image_size),
                "--lr", lr(s), "--amp", amp, "--device", "cpu", "-p", "1000000", "--out-dir", out,
            ),
            common.subprocess_env(),
        )  # fmt: skip
        records = [json.loads(line) for line in (Path(out) / "metrics.jsonl").open()]
    last = [r for r in records if r["split"] == "train"][-1]
    DATA_WAIT.setdefault(amp, []).append(round(last["data_wait"], 3))
    return last["samples_per_sec"]


def classic(root: Path, s: common.Scale) -> float:
    args = ["-b", str(s.batch), "-j", str(WORKERS), "--image-size", str(s.image_size)]
    args += ["--lr", lr(s)]
    result = common.run_json(
        common.python("-m", "bench.classic", str(root), "--epochs", "2", *args),
        common.subprocess_env(),
    )
    return result["samples_per_sec"][-1]


def bound(root: Path, s: common.Scale, amp: str) -> float:
    args = ["-b", str(s.batch), "-j", str(WORKERS), "--image-size", str(s.image_size)]
    args += ["--lr", lr(s)]
    result = common.run_json(
        common.python("-m", "bench.bound", str(root), "--epochs", "2", "--amp", amp, *args),
        common.subprocess_env(),
    )
    return result["samples_per_sec"][-1]


def step(s: common.Scale, variant: str, quick: bool) -> float:
    args = ["-b", str(s.batch), "--image-size", str(s.image_size), "--lr", lr(s)]
    args += ["--steps", str(STEPS[quick]), "--classes", str(s.classes)]
    result = common.run_json(
        common.python("-m", "bench.step", variant, *args), common.subprocess_env()
    )
    return result["samples_per_sec"]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke check")
    parser.add_argument("--repeats", type=int, help="runs of each contender (default: the scale's)")
    parser.add_argument("--amps", nargs="+", choices=("bf16", "none"), help="default: bf16 (where "
                        "the CPU has bf16 units) and none")  # fmt: skip
    args = parser.parse_args(argv)
    quick = args.quick
    amps = args.amps or (["bf16", "none"] if common.native_amp() == "bf16" else ["none"])
    named = {"bf16": "bf16", "none": "fp32"}
    s = common.scale(quick)
    if args.repeats:
        s = dataclasses.replace(s, repeats=args.repeats)
    root = common.jpeg_folder(s)
    contenders = {"classic loop, fp32": lambda: classic(root, s)}
    for amp in amps:
        contenders[f"ddptrain, {named[amp]}"] = lambda amp=amp: ddptrain(root, s, amp)
    bound_name = f"ddptrain compute bound, {named[amps[0]]}"
    contenders[bound_name] = lambda: bound(root, s, amps[0])
    contenders["step only: classic, fp32"] = lambda: step(s, "classic", quick)
    for amp in amps:
        contenders[f"step only: ddptrain, {named[amp]}"] = lambda amp=amp: step(s, amp, quick)
    rows = common.compare(contenders, s, "samples/s")
    classic_e2e, classic_step = "classic loop, fp32", "step only: classic, fp32"
    ratios = []
    for amp in (named[a] for a in amps):
        e2e, only = f"ddptrain, {amp}", f"step only: ddptrain, {amp}"
        ratios += [
            common.paired_ratio(
                f"a. ddptrain {amp} / classic, end to end",
                rows, lambda m, e2e=e2e: m[e2e] / m[classic_e2e], None,
            ),
            common.paired_ratio(
                f"a. ceiling: ddptrain {amp} step / classic step",
                rows, lambda m, only=only: m[only] / m[classic_step], None,
            ),
            common.paired_ratio(
                f"a. ddptrain {amp}: end-to-end gain / step-only gain",
                rows,
                lambda m, e2e=e2e, only=only: (m[e2e] / m[classic_e2e])
                / (m[only] / m[classic_step]),
                TARGETS["step"],
            ),
        ]  # fmt: skip
    first = named[amps[0]]
    ratios.append(
        common.paired_ratio(
            f"b. ddptrain {first} / its compute bound",
            rows,
            lambda m: m[f"ddptrain, {first}"] / m[bound_name],
            TARGETS["bound"],
        )
    )
    settings = {
        "arch": "resnet18",
        "amps": amps,
        "image_size": s.image_size,
        "global_batch": s.batch,
        "workers": WORKERS,
        "lr": float(lr(s)),
        "train_images": s.classes * s.train_per_class,
        "source_images": f"{s.width}x{s.height} JPEG q90",
        "measured": "second of 2 epochs",
        "step_only": f"{STEPS[quick]} steps after 2 warm-up steps, same batches in memory, "
        "torch's default threads",
        "ratios": "median over repeats of each repeat's ratio (contenders side by side)",
        "repeats": s.repeats,
        # every try, the disturbed ones measured again included
        "data_wait_share": {
            f"ddptrain, {'fp32' if a == 'none' else a}": v for a, v in DATA_WAIT.items()
        },  # fmt: skip
    }
    common.print_table("Training throughput (end to end, CPU)", rows, ratios)
    for name, shares in settings["data_wait_share"].items():
        waits = ", ".join(f"{100 * v:.0f}%" for v in shares)
        print(f"  {name}: share of the epoch waiting for the loader (data_wait): {waits}")
    path = common.write_results("train", quick, settings, rows, ratios)
    print(f"  -> {path}")
    return {"rows": rows, "ratios": ratios}


if __name__ == "__main__":
    main()
