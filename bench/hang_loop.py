"""The hang loop: one e2e test run again and again under load, counting the runs that hang.

    python -m bench.hang_loop [--runs 300] [--parallel 3] [--busy 3] [--hours H]
                              [--test FILE --select EXPR]

By default the test is the kill test whose job hung about 2% of the time when loader workers
were forked from the training process (4 of 192 runs): a 2-rank torchrun job with one loader
worker per rank, SIGTERMed while rank 0 stands at epoch 1's evaluation, where the val loader
starts its worker, then resumed. In rounds, `--parallel` sessions of pytest run it `--batch`
times each (bench/repeat.py makes the copies), beside `--busy` processes that spin on a core
each, until `--runs` runs are done or `--hours` have passed. A run
counts as a hang where the test's failure message says a job did not stop or end in time (its
240 s deadlines: tests/e2e/cli.py says "no process of the job stopped" or "did not end", with
the job's stacks), or pytest-timeout's (1500 s for the whole test); any other failure is
counted apart. After each round, prints the counts so far and writes
bench/results/hang_loop.json (each failure's message); the pytest logs are under
bench/.data/hang_loop/.
"""

import argparse
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

from bench.common import machine

TEST = "tests/e2e/test_kills.py"
SELECT = "test_sigterm_to_every_process_with_loader_workers_stops_the_job_saved and evaluation"
# In a failure's message: the test's deadlines (tests/e2e/cli.py), or pytest-timeout's.
HANG_SIGNS = ("did not end", "no process of the job stopped", "TimeoutExpired", "Timeout (>")
ROOT = Path(__file__).parents[1]
LOGS = ROOT / "bench" / ".data" / "hang_loop"
RESULTS = ROOT / "bench" / "results" / "hang_loop.json"


def session(
    test: str, select: str, runs: int, index: int, lane: int
) -> tuple[subprocess.Popen, Path]:
    """Pytest session `index`, running the selected test `runs` times in lane `lane`'s
    temporary folder, its JUnit report at the path returned."""
    report = LOGS / f"session-{index}.xml"
    command = [
        *(sys.executable, "-m", "pytest", "-q", "-p", "bench.repeat", "--repeat", str(runs)),
        *("-p", "no:cacheprovider", "--junitxml", str(report), test, "-k", select),
        *("--timeout", "1500"),  # the test's own deadlines (240 s a wait) name a hang first
        *("--basetemp", str(LOGS / f"tmp-{lane}")),  # emptied as the session starts
    ]
    log = open(LOGS / f"session-{index}.log", "w")  # noqa: SIM115 (open while it runs)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env
    ), report


def outcomes(report: Path) -> list[dict]:
    """Each run's outcome from a JUnit report: passed, hang or failed, and the message."""
    found = []
    for case in ElementTree.parse(report).getroot().iter("testcase"):
        failure = case.find("failure")
        if failure is None:
            failure = case.find("error")
        if failure is None:
            found.append({"name": case.get("name"), "outcome": "passed"})
            continue
        message, text = failure.get("message", ""), failure.text or ""
        hang = any(sign in message for sign in HANG_SIGNS)
        found.append(
            {
                "name": case.get("name"),
                "outcome": "hang" if hang else "failed",
                "message": message,
                "text": text,
            }
        )
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=300)
    parser.add_argument("--parallel", type=int, default=3)
    parser.add_argument("--busy", type=int, default=3)
    parser.add_argument("--batch", type=int, default=5, help="runs per pytest session")
    parser.add_argument("--hours", type=float, help="start no round after this long")
    parser.add_argument("--test", default=TEST, help="the test file")
    parser.add_argument("--select", default=SELECT, help="pytest -k: the test in the file")
    args = parser.parse_args()
    LOGS.mkdir(parents=True, exist_ok=True)
    spin = [sys.executable, "-c", "while True: pass"]
    busy = [subprocess.Popen(spin) for _ in range(args.busy)]
    started, runs, round_ = time.monotonic(), [], 0
    try:
        while len(runs) < args.runs:
            if args.hours is not None and time.monotonic() - started > args.hours * 3600:
                break
            # Rounds of short sessions: each round's results are kept (JUnit reports are
            # written at a session's end), and a loop cut short keeps what it counted.
            sessions = [
                session(args.test, args.select, args.batch, round_ * args.parallel + i, i)
                for i in range(args.parallel)
            ]
            for process, _ in sessions:
                process.wait()
            runs += [run for _, report in sessions if report.exists() for run in outcomes(report)]
            round_ += 1
            write(args, runs, started)
    finally:
        for process in busy:
            process.kill()


def write(args, runs: list[dict], started: float) -> None:
    counts = {
        kind: sum(r["outcome"] == kind for r in runs) for kind in ("passed", "hang", "failed")
    }
    hours = (time.monotonic() - started) / 3600
    print(
        f"{len(runs)} runs of {args.select} in {hours:.2f} h, {args.parallel} at a time beside "
        f"{args.busy} busy processes: {counts['hang']} hung, {counts['failed']} failed otherwise",
        flush=True,
    )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(
        json.dumps(
            {
                "machine": machine(),
                "test": f"{args.test} -k {args.select!r}",
                "parallel": args.parallel,
                "busy": args.busy,
                "runs": len(runs),
                "hours": round(hours, 2),
                "counts": counts,
                "failures": [r for r in runs if r["outcome"] != "passed"],
            },
            indent=2,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
