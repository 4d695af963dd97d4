"""End-to-end training throughput on a generated JPEG ImageFolder, side by side:

  a. ddptrain (its real CLI, on the CPU) against the classic example's loop (bench.classic),
     in fp32 (ddptrain's defaults, so channels_last) and with --amp bf16;
  b. ddptrain against its own compute bound (bench.bound: the same loop fed from memory).

Every contender trains resnet18 at 224 px with the same global batch and loader workers on
the same cores, for 2 epochs; the figure is the second epoch's (the first warms up: worker
start, kernel selection). Repeats alternate between contenders; medians are reported.

    python -m bench.train [--quick]
"""

import argparse
import json
import tempfile
from pathlib import Path

from bench import common

WORKERS = 2


def lr(s: common.Scale) -> str:
    """The classic example's 0.1 for 256 images, scaled to the batch: at 0.1 a batch of 32
    diverges, and denormal and infinite values slow every CPU kernel down several times."""
    return str(0.1 * s.batch / 256)


TARGETS = {"bf16": 3.0, "fp32": 1.2, "bound": 0.9}


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
    return [r["samples_per_sec"] for r in records if r["split"] == "train"][-1]


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


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke check")
    quick = parser.parse_args(argv).quick
    s = common.scale(quick)
    root = common.jpeg_folder(s)
    contenders = {
        "classic loop, fp32": lambda: classic(root, s),
        "ddptrain, fp32": lambda: ddptrain(root, s, "none"),
        "ddptrain, bf16": lambda: ddptrain(root, s, "bf16"),
        "ddptrain compute bound, bf16": lambda: bound(root, s, "bf16"),
    }
    rows = common.compare(contenders, s, "samples/s")
    m = {r["name"]: r["median"] for r in rows}
    classic_fp32, bf16, fp32 = m["classic loop, fp32"], m["ddptrain, bf16"], m["ddptrain, fp32"]
    ratios = [
        common.ratio_row("a. ddptrain bf16 / classic", bf16 / classic_fp32, TARGETS["bf16"]),
        common.ratio_row("a. ddptrain fp32 / classic", fp32 / classic_fp32, TARGETS["fp32"]),
        common.ratio_row(
            "b. ddptrain bf16 / its compute bound",
            bf16 / m["ddptrain compute bound, bf16"],
            TARGETS["bound"],
        ),
    ]
    settings = {
        "arch": "resnet18",
        "image_size": s.image_size,
        "global_batch": s.batch,
        "workers": WORKERS,
        "lr": float(lr(s)),
        "train_images": s.classes * s.train_per_class,
        "source_images": f"{s.width}x{s.height} JPEG q90",
        "measured": "second of 2 epochs",
        "repeats": s.repeats,
    }
    common.print_table("Training throughput (end to end, CPU)", rows, ratios)
    path = common.write_results("train", quick, settings, rows, ratios)
    print(f"  -> {path}")
    return {"rows": rows, "ratios": ratios}


if __name__ == "__main__":
    main()
