"""What a cache folder per rank costs `--compile`: a 2-rank torchrun job's wall time with each
local rank compiling into a folder of its own (ddptrain's default) against both ranks sharing one
folder (TORCHINDUCTOR_CACHE_DIR set), cold (empty folders) and warm (the folders a cold run left).

    python -m bench.compile_start [--repeats 2]

The job: resnet18 on a small generated folder (3 classes, 24 px, 16 px crops, `-b 8`, `-j 0`, one
epoch), each variant in fresh temporary folders, the variants alternating. Shared folders can race
(the defect the per-rank default avoids); a run that fails is counted, not timed. Writes
bench/results/compile_start.json.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import RESULTS, machine
from ddptrain.data.synth import SynthSpec, write

DATA = SynthSpec(classes=3, train_per_class=8, val_per_class=5, size=24, seed=0)


def job(data: Path, out: Path, env: dict) -> float | None:
    """Seconds the compiled job took, None where it failed."""
    command = [
        *(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"),
        *("-m", "ddptrain", "train", str(data), "--image-size", "16", "-b", "8", "-j", "0"),
        *("--epochs", "1", "--seed", "0", "--compile", "--out-dir", str(out)),
    ]
    start = time.monotonic()
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1200)
    if done.returncode != 0:
        print(done.stderr[-2000:], file=sys.stderr)
        return None
    return time.monotonic() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    times: dict[str, list] = {}
    with tempfile.TemporaryDirectory() as scratch:
        data = write(DATA, Path(scratch) / "data")
        for repeat in range(args.repeats):
            for variant in ("per rank", "shared"):
                # A fresh temp folder: inductor's default cache folder lies under it.
                tmp = Path(scratch) / f"{variant}-{repeat}".replace(" ", "-")
                tmp.mkdir()
                env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp)}
                env.pop("TORCHINDUCTOR_CACHE_DIR", None)
                if variant == "shared":
                    env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp / "inductor")
                for state in ("cold", "warm"):
                    took = job(data, tmp / f"out-{state}", env)
                    times.setdefault(f"{variant}, {state}", []).append(took)
                    print(f"{variant}, {state}: {took if took is None else f'{took:.1f} s'}")
    summary = {
        name: {
            "median_s": statistics.median(ok) if (ok := [t for t in runs if t]) else None,
            "runs_s": runs,
            "failed": sum(t is None for t in runs),
        }
        for name, runs in times.items()
    }
    for name, found in summary.items():
        print(f"{name}: median {found['median_s']} s, {found['failed']} failed")
    out = RESULTS / "compile_start.json"
    out.write_text(json.dumps({"machine": machine(), "jobs": summary}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
