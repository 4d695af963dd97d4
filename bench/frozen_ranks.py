"""Frozen ranks, each named: a rank of a 2-rank job is frozen (SIGSTOP, as a host that hangs or a
process stuck in the kernel) at every point of a step, at evaluation and at a checkpoint's
stages, and from outside at moments spread over an epoch; what does the other rank's error say,
and how long after the freeze?

    python -m bench.frozen_ranks [--dist-timeout 10] [--instants 8]

Under torchrun rank 1 is frozen (rank 0 where only it acts: a checkpoint's writing), and under
`--dist-url tcp://` rank 0, which then also holds the rendezvous store. The points are
faults.py's (the rank stops itself there: `DDPTRAIN_TEST_KILL=POINT:RANK:STEP`,
`DDPTRAIN_TEST_SIGNAL=SIGSTOP`); the instants are SIGSTOPs sent by this script to rank 1 at
--instants moments spread over the second epoch, whatever the rank is doing then. Prints each
case's line and delay; writes bench/results/frozen_ranks.json.
"""

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import RESULTS, descendants, machine
from ddptrain.distributed.ports import free_port

# (point, frozen rank under torchrun, global step): a checkpoint is written at step 2 (every 2)
POINTS = [
    ("data", 1, 2),
    ("backward", 1, 2),
    ("between", 1, 3),
    ("evaluation", 1, 6),
    ("before_rename", 0, 2),
    ("after_rename", 0, 4),
]


def flags(data: Path, out: Path, timeout: int) -> list[str]:
    return [
        *("train", str(data), "--out-dir", str(out), "--image-size", "16", "-b", "8"),
        *("-j", "1", "--seed", "0", "-p", "1", "--epochs", "3", "--checkpoint-every", "2"),
        *("--dist-timeout", str(timeout)),
    ]


def environment(**extra) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", **extra}


def torchrun(args: list[str], env: dict) -> list[subprocess.Popen]:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node=2", "-m", "ddptrain", *args]
    return [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)]


def tcp_pair(args: list[str], env: dict) -> list[subprocess.Popen]:
    url = f"tcp://127.0.0.1:{free_port()}"
    return [
        subprocess.Popen(
            [sys.executable, "-m", "ddptrain", *args, "--dist-url", url, "--world-size", "2"]
            + ["--rank", str(rank)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
        )
        for rank in range(2)
    ]


def state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "X"


def watch(jobs: list[subprocess.Popen], timeout: float, freeze=None) -> dict:
    """The first `ddptrain: error:` line of the jobs and how long after a process of theirs
    stopped it came; `freeze()`, where given, stops one itself (and says when)."""
    lines, frozen_at, deadline = [], None, time.monotonic() + timeout
    for job in jobs:
        os.set_blocking(job.stderr.fileno(), False)
    buffers = [b""] * len(jobs)
    running = True
    while time.monotonic() < deadline and not lines and running:
        running = any(job.poll() is None for job in jobs)  # read once more after they end
        if freeze is not None and frozen_at is None:
            frozen_at = freeze()
        for i, job in enumerate(jobs):
            buffers[i] += job.stderr.read() or b""
        text = b"".join(buffers).decode(errors="replace")
        lines = [line for line in text.splitlines() if line.startswith("ddptrain: error:")]
        if frozen_at is None and freeze is None:
            every = [p for job in jobs for p in [job.pid, *descendants(job.pid)]]
            if any(state(p) == "T" for p in every):
                frozen_at = time.monotonic()
        time.sleep(0.1)
    took = time.monotonic() - frozen_at if frozen_at and lines else None
    found = {"line": lines[0] if lines else None, "seconds": took and round(took, 1)}
    if not lines:  # ended without an error (frozen after its last collective?), or still waits
        found["exit codes"] = [job.poll() for job in jobs]
    return found


def end(jobs: list[subprocess.Popen]) -> None:
    for job in jobs:
        for pid in [job.pid, *descendants(job.pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        job.wait()


def at_points(data: Path, timeout: int) -> list[dict]:
    found = []
    for launcher, start in (("torchrun", torchrun), ("tcp://", tcp_pair)):
        for point, rank, step in POINTS:
            rank = 0 if launcher == "tcp://" else rank
            stop = {
                "DDPTRAIN_TEST_KILL": f"{point}:{rank}:{step}",
                "DDPTRAIN_TEST_SIGNAL": "SIGSTOP",
            }
            with tempfile.TemporaryDirectory() as out:
                jobs = start(flags(data, Path(out), timeout), environment(**stop))
                try:
                    seen = watch(jobs, timeout + 120)
                finally:
                    end(jobs)
            found.append({"launcher": launcher, "point": point, "frozen": rank, **seen})
            found[-1]["named"] = names_it(seen["line"], rank)
            print(found[-1], flush=True)
    return found


def at_instants(data: Path, timeout: int, instants: int) -> list[dict]:
    """SIGSTOP to rank 1 from outside, at moments spread over the second epoch (3 steps of
    about equal length, then its evaluation and checkpoint)."""
    found = []
    for i in range(instants):
        with tempfile.TemporaryDirectory() as out:
            (job,) = torchrun(flags(data, Path(out), timeout), environment())
            try:
                for line in job.stdout:  # the second epoch's first step is done
                    if line.startswith(b"epoch 2/3 [1/"):
                        break
                delay = i * 0.25
                time.sleep(delay)
                # the agent's own children, whose command runs ddptrain's module (its fork
                # servers and their workers also carry LOCAL_RANK and "ddptrain")
                ranks = [p for p in _children(job.pid) if b"-m\0ddptrain" in _cmdline(p)]
                (rank1,) = [p for p in ranks if _local_rank(p) == 1]

                def freeze(rank1=rank1):
                    os.kill(rank1, signal.SIGSTOP)
                    return time.monotonic()

                seen = watch([job], timeout + 120, freeze)
            finally:
                end([job])
        found.append({"launcher": "torchrun", "after step 4 by": delay, "frozen": 1, **seen})
        found[-1]["named"] = names_it(seen["line"], 1)
        print(found[-1], flush=True)
    return found


def _children(parent: int) -> list[int]:
    return [pid for pid in descendants(parent) if _parent(pid) == parent]


def _parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except OSError:
        return -1


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _local_rank(pid: int) -> int:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return -1
    found = [v for v in environ if v.startswith(b"LOCAL_RANK=")]
    return int(found[0].split(b"=")[1]) if found else -1


def names_it(line: str | None, rank: int) -> bool:
    """Whether the error names the frozen rank, where it was or that it held the store."""
    said = (f"rank {rank} stopped answering", f"rank {rank} was last in", f"rank {rank}, which")
    return bool(line) and any(words in line for words in said)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dist-timeout", type=int, default=10)
    parser.add_argument("--instants", type=int, default=8)
    parser.add_argument("--instants-only", action="store_true", help="skip the points")
    args = parser.parse_args()
    from ddptrain.data.synth import SynthSpec, write

    with tempfile.TemporaryDirectory() as folder:
        data = write(
            SynthSpec(classes=3, train_per_class=8, val_per_class=5, size=24), Path(folder)
        )
        points = [] if args.instants_only else at_points(data, args.dist_timeout)
        instants = at_instants(data, args.dist_timeout, args.instants)
    named = sum(r["named"] for r in points + instants)
    print(f"{named} of {len(points) + len(instants)} errors name the frozen rank's place")
    path = RESULTS / "frozen_ranks.json"
    summary = {"machine": machine(), "dist_timeout": args.dist_timeout}
    path.write_text(json.dumps({**summary, "points": points, "instants": instants}, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
