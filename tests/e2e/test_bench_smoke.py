"""The data pipeline benchmarks run end to end at --quick sizes (a smoke check, not a timing)."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_quick(module: str, cache: Path, *args: str) -> dict:
    """`python -m bench.MODULE --quick ARGS` with its cache in `cache`: its results file."""
    env = {
        **os.environ,
        "DDPTRAIN_BENCH_CACHE": str(cache),
        "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")]),
        "PYTHONWARNINGS": "ignore",
    }
    done = subprocess.run(
        [sys.executable, "-m", f"bench.{module}", "--quick", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return json.loads((cache / "results-quick" / f"{module}.json").read_text())


def test_pipeline_bench_quick(tmp_path):
    result = run_quick("pipeline", tmp_path)
    assert len(result["measured"]) == 3 and all(r["median"] > 0 for r in result["measured"])
    assert {r["name"] for r in result["ratios"]} >= {"c. ddptrain / classic, per core"}


def test_input_pipeline_bench_quick(tmp_path):
    """Per core only: the end-to-end part is bench.train's, with a packed set for DATA."""
    result = run_quick("input_pipeline", tmp_path, "--per-core-only")
    assert len(result["measured"]) == 4 and all(r["median"] > 0 for r in result["measured"])
    names = {r["name"] for r in result["ratios"]}
    assert {"ddptrain packed / folder, per core", "ddptrain packed 73 / classic, per core"} <= names
