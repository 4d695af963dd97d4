"""Random kill trials: SIGKILL one rank of a 2-rank torchrun job at a random point and step, let
torchrun --max-restarts restart it with --resume auto, and check the result is bitwise the
uninterrupted run's. Prints a table and writes bench/results/kill_trials.json.

    python bench/kill_trials.py [--trials 10] [--seed 0]

Each trial reports the work lost: optimizer steps done before the kill that were redone after
the restart, and the extra wall time against the uninterrupted run (restart included).
"""

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from ddptrain.data.synth import SynthSpec, write
from ddptrain.faults import POINTS

STEPS_PER_EPOCH, EPOCHS, EVERY = 6, 2, 3  # 48 images, global batch 8
RESULTS = Path(__file__).parent / "results" / "kill_trials.json"


def train(
    data: Path, out: Path, env: dict | None = None
) -> tuple[subprocess.CompletedProcess, float]:
    command = [
        *(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"),
        *("--max-restarts=2", "-m", "ddptrain", "train", str(data), "--out-dir", str(out)),
        *("--image-size", "16", "-b", "8", "-j", "0", "--seed", "0", "-p", "100"),
        *("--epochs", str(EPOCHS), "--checkpoint-every", str(EVERY), "--resume", "auto"),
    ]
    start = time.monotonic()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", **(env or {})}
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    return result, time.monotonic() - start


def outcome(out: Path) -> tuple[dict, list]:
    ckpt = torch.load(out / "checkpoint.pt", weights_only=True)
    tensors = {f"model.{k}": v for k, v in ckpt["model"].items()}
    for key, state in ckpt["optimizer"]["state"].items():
        tensors.update({f"optimizer.{key}.{n}": v for n, v in state.items()})
    lines = (out / "metrics.jsonl").read_text().splitlines()
    val = [r for r in map(json.loads, lines) if r["split"] == "val"]
    return {"tensors": tensors, "scheduler": ckpt["scheduler"]}, val


def same(a: tuple[dict, list], b: tuple[dict, list]) -> bool:
    (state_a, val_a), (state_b, val_b) = a, b
    tensors_a, tensors_b = state_a["tensors"], state_b["tensors"]
    return (
        tensors_a.keys() == tensors_b.keys()
        and all(torch.equal(tensors_a[k], tensors_b[k]) for k in tensors_a)
        and state_a["scheduler"] == state_b["scheduler"]
        and val_a == val_b
    )


def random_fault(rng: random.Random) -> tuple[str, int, int]:
    point = rng.choice(POINTS)
    total = STEPS_PER_EPOCH * EPOCHS
    if point.endswith("rename"):  # only rank 0 writes, at checkpoint steps
        saves = sorted(
            {*range(EVERY, total + 1, EVERY), *range(STEPS_PER_EPOCH, total + 1, STEPS_PER_EPOCH)}
        )
        return point, 0, rng.choice(saves)
    return point, rng.randrange(2), rng.randint(1, total)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    options = parser.parse_args()
    rng = random.Random(options.seed)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        data = write(SynthSpec(classes=3, train_per_class=16, val_per_class=5, size=24), root / "d")
        result, reference_seconds = train(data, root / "reference")
        assert result.returncode == 0, result.stderr
        reference = outcome(root / "reference")
        trials = []
        for trial in range(options.trials):
            point, rank, step = random_fault(rng)
            out, marker = root / f"trial{trial}", root / f"killed{trial}"
            env = {
                "DDPTRAIN_TEST_KILL": f"{point}:{rank}:{step}",
                "DDPTRAIN_TEST_KILL_ONCE": str(marker),
            }
            result, seconds = train(data, out, env)
            resumed = re.search(r"resumed from .*checkpoint-(\d+)\.pt", result.stdout)
            done_at_kill = step if point.endswith("rename") else step - 1
            record = {
                "point": point,
                "rank": rank,
                "step": step,
                "killed": marker.exists(),
                "exit": result.returncode,
                "bitwise_equal": result.returncode == 0 and same(reference, outcome(out)),
                "resumed_from_step": int(resumed[1]) if resumed else 0,
                "steps_lost": done_at_kill - (int(resumed[1]) if resumed else 0),
                "extra_seconds": round(seconds - reference_seconds, 1),
            }
            trials.append(record)
            print(
                f"{trial + 1:>2} {point:>13} rank {rank} step {step:>2}: exit {record['exit']}, "
                f"bitwise equal {record['bitwise_equal']}, resumed from step "
                f"{record['resumed_from_step']}, {record['steps_lost']} steps and "
                f"{record['extra_seconds']} s lost",
                flush=True,
            )
    passed = sum(t["killed"] and t["bitwise_equal"] for t in trials)
    print(
        f"{passed}/{len(trials)} trials killed, restarted and bitwise equal; uninterrupted run "
        f"{reference_seconds:.1f} s"
    )
    RESULTS.parent.mkdir(exist_ok=True)
    summary = {"passed": passed, "trials": trials, "reference_seconds": round(reference_seconds, 1)}
    RESULTS.write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
