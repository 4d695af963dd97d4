"""The data pipeline benchmark runs end to end at --quick sizes (a smoke check, not a timing)."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_pipeline_bench_quick(tmp_path):
    env = {
        **os.environ,
        "DDPTRAIN_BENCH_CACHE": str(tmp_path),
        "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")]),
        "PYTHONWARNINGS": "ignore",
    }
    done = subprocess.run(
        [sys.executable, "-m", "bench.pipeline", "--quick"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads((tmp_path / "results-quick" / "pipeline.json").read_text())
    assert len(result["measured"]) == 3 and all(r["median"] > 0 for r in result["measured"])
    assert {r["name"] for r in result["ratios"]} >= {"c. ddptrain / classic, per core"}


def test_input_pipeline_bench_quick(tmp_path):
    """Per core only: the end-to-end part is bench.train's, with a packed set for DATA."""
    env = {
        **os.environ,
        "DDPTRAIN_BENCH_CACHE": str(tmp_path),
        "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")]),
        "PYTHONWARNINGS": "ignore",
    }
    done = subprocess.run(
        [sys.executable, "-m", "bench.input_pipeline", "--quick", "--per-core-only"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads((tmp_path / "results-quick" / "input_pipeline.json").read_text())
    assert len(result["measured"]) == 4 and all(r["median"] > 0 for r in result["measured"])
    names = {r["name"] for r in result["ratios"]}
    assert {"ddptrain packed / folder, per core", "ddptrain packed 73 / classic, per core"} <= names
