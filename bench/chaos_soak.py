"""The chaos soak: a small job under `torchrun --max-restarts`, disrupted at random moments until
it has taken `--disruptions` of them, then checked against the same job never disrupted.

    python -m bench.chaos_soak [--disruptions 50] [--seed 0] [--dist-timeout 20]

The job: 2 ranks, resnet18 at 16 px on a generated set (48 train, 15 val images, `-b 8`: 6 steps
an epoch), one loader worker per rank (-j 1), an EMA, an evaluation every epoch, a checkpoint
every 2 steps, `--resume auto`, `--seed 0`, `--dist-timeout` as given. Each disruption, at a
random moment 0 to 8 s after the job trains (its loader workers run) again, is one of:
- SIGKILL of a random process of the job: a rank, a loader worker, or a rank's fork server;
- SIGSTOP of one (a frozen process: the others give up after --dist-timeout, torchrun ends the
  group and starts it again);
- SIGTERM of the whole job (every process, as SLURM's scancel): it stops saved, and the soak
  starts it again with --resume auto.
After each, once the job runs again (or has ended), no process of the job from before may be
left alive but the torchrun agent. Rounds of the job run until the disruptions are done; each
round's final checkpoint must equal the undisrupted job's bitwise (model, optimizer, EMA,
scheduler), and its metrics.jsonl and per_class.jsonl must hold each epoch once per split.
Prints each disruption and the totals; writes bench/results/chaos_soak.json.
"""

import argparse
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

from bench.common import RESULTS, descendants, machine

EPOCHS = 8
STARTS = 40  # of a round's job (torchrun's restarts apart): one that never ends is reported


def job_command(data: Path, out: Path, timeout: int) -> list[str]:
    return [
        *(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"),
        *("--max-restarts=1000", "-m", "ddptrain", "train", str(data), "--out-dir", str(out)),
        *("--image-size", "16", "-b", "8", "-j", "1", "--seed", "0", "-p", "100"),
        *("--epochs", str(EPOCHS), "--checkpoint-every", "2", "--resume", "auto"),
        *("--model-ema", "--dist-timeout", str(timeout)),
    ]


def environment() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def _stat(pid: int) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def alive(pid: int, started: str) -> bool:
    """Whether pid is still the process that started at `started` (not a zombie, not reused)."""
    fields = _stat(pid)
    return fields is not None and fields[19] == started and fields[0] not in ("Z", "X")


def processes(root: int) -> dict[int, tuple[str, str]]:
    """Every process below root: pid -> (its start time, its role)."""
    found = {}
    for pid in descendants(root):  # parents first: a worker's role needs its parent's
        fields = _stat(pid)
        if fields is not None:
            found[pid] = (fields[19], _role(pid, int(fields[1]), found))
    return found


def _role(pid: int, parent: int, known: dict) -> str:
    command = _cmdline(pid)
    if "forkserver import main" in command:
        return "loader worker" if known.get(parent, ("", ""))[1] == "fork server" else "fork server"
    if "resource_tracker" in command:
        return "resource tracker"
    if "-m ddptrain" in command or "ddptrain" in command:
        return "rank"
    return "other"


def disrupt(rng: random.Random, job: subprocess.Popen) -> dict | None:
    """One disruption of the running job: the kind, then the role it hits (each role as likely,
    whatever the number of its processes), then a process of it. What it was, or None where
    the job has no process of that role now."""
    below = processes(job.pid)
    kind = rng.choice(["SIGKILL", "SIGKILL", "SIGSTOP", "SIGTERM job"])
    if kind == "SIGTERM job":
        for pid in [job.pid, *below]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        return {"kind": kind, "target": "every process"}
    role = rng.choice(HIT)
    targets = [pid for pid, (_, its) in below.items() if its == role]
    if not targets:
        return None
    pid = rng.choice(targets)
    os.kill(pid, getattr(signal, kind))
    return {"kind": kind, "target": role, "pid": pid}


def training(job: subprocess.Popen, seen: dict, within: float = 600) -> bool:
    """Waits until the job trains (its loader workers run), while noting its processes; False
    where it ended first, or did not get there in time."""
    deadline = time.monotonic() + within
    while job.poll() is None and time.monotonic() < deadline:
        now = processes(job.pid)
        seen.update(now)
        if any(role == "loader worker" for _, role in now.values()):
            return True
        time.sleep(0.5)
    return False


HIT = ("rank", "loader worker", "fork server")


def settled(job: subprocess.Popen, before: dict, seen: dict, dist_timeout: int) -> str:
    """Waits until the job ended or started its ranks again (torchrun's restart), or, where it
    goes on as it was, a while; returns which."""
    ranks = {pid for pid, (_, role) in before.items() if role == "rank"}
    deadline = time.monotonic() + dist_timeout + 60
    while time.monotonic() < deadline:
        if job.poll() is not None:
            return "ended"
        now = processes(job.pid)
        seen.update(now)
        if {pid for pid, (_, role) in now.items() if role == "rank"} - ranks:
            return "restarted"
        time.sleep(0.5)
    return "went on"


def orphans(job: subprocess.Popen, seen: dict, within: float = 15) -> list[str]:
    """The processes seen in the job that live on outside it (once `within` seconds passed for
    those ending); each is killed after it is listed."""
    deadline = time.monotonic() + within
    while True:
        current = processes(job.pid) if job.poll() is None else {}
        left = {
            pid: role
            for pid, (started, role) in seen.items()
            if pid not in current and alive(pid, started)
        }
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return [f"{role} {pid}" for pid, role in left.items()]


def round_of(data: Path, out: Path, args, rng: random.Random, left: int) -> list[dict]:
    """One job, disrupted up to `left` times, run until it has trained every epoch."""
    done, seen = [], {}
    command = job_command(data, out, args.dist_timeout)
    for _ in range(STARTS):
        with tempfile.TemporaryFile() as stderr:
            job = subprocess.Popen(
                command, stdout=subprocess.DEVNULL, stderr=stderr, env=environment()
            )
            while len(done) < left and training(job, seen):
                wait_until = time.monotonic() + rng.uniform(0, 8)  # from a moment it trains
                while time.monotonic() < wait_until and job.poll() is None:
                    seen.update(processes(job.pid))
                    time.sleep(0.2)
                if job.poll() is not None:
                    break
                before = processes(job.pid)
                seen.update(before)
                what = disrupt(rng, job)
                if what is None:
                    continue
                what["outcome"] = settled(job, before, seen, args.dist_timeout)
                what["orphans"] = orphans(job, seen)
                print(f"disruption {len(done) + 1}: {what}", flush=True)
                done.append(what)
            job.wait(timeout=3600)
            stderr.seek(0)
            said = stderr.read().decode(errors="replace").splitlines()[-5:]
        if done:
            done[-1]["orphans"] += orphans(job, seen)  # what the job's end leaves
        if trained_to_the_end(out):
            return done
        # stopped by SIGTERM: started again, as a requeued job, from its checkpoint
    done.append({"kind": "none", "target": "", "orphans": [], "did not finish": said})
    return done


def trained_to_the_end(out: Path) -> bool:
    try:
        state = torch.load(out / "checkpoint.pt", weights_only=True)
    except (OSError, RuntimeError):
        return False
    return state.get("epoch") == EPOCHS


def final_state(out: Path) -> dict:
    checkpoint = torch.load(out / "checkpoint.pt", weights_only=True)
    keep = ("model", "optimizer", "model_ema", "scheduler", "epoch", "best_acc1")
    return {key: checkpoint.get(key) for key in keep}


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def epochs_once(out: Path) -> list[str]:
    """Problems of metrics.jsonl and per_class.jsonl: an epoch missing or doubled per split."""
    problems = []
    for name in ("metrics.jsonl", "per_class.jsonl"):
        records = [json.loads(line) for line in (out / name).read_text().splitlines()]
        counts = Counter((r["split"], r["epoch"]) for r in records)
        for split in {s for s, _ in counts}:
            seen = [counts[(split, e)] for e in range(1, EPOCHS + 1)]
            if seen != [1] * EPOCHS:
                problems.append(f"{name} {split}: records per epoch {seen}")
    return problems


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--disruptions", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dist-timeout", type=int, default=20)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    from ddptrain.data.synth import SynthSpec, write

    work = Path(tempfile.mkdtemp(prefix="chaos-"))
    data = write(SynthSpec(classes=3, train_per_class=16, val_per_class=5, size=24), work / "d")
    reference = work / "reference"
    subprocess.run(job_command(data, reference, args.dist_timeout), env=environment(), check=True)
    expected = final_state(reference)
    rounds, disruptions, started = [], [], time.monotonic()
    while len(disruptions) < args.disruptions:
        out = work / f"round-{len(rounds)}"
        done = round_of(data, out, args, rng, args.disruptions - len(disruptions))
        unfinished = [d["did not finish"] for d in done if "did not finish" in d]
        done = [d for d in done if "did not finish" not in d]
        disruptions += done
        if unfinished:
            problems = [f"did not finish in {STARTS} starts: {unfinished[0]}"]
        else:
            problems = epochs_once(out)
            if not same(final_state(out), expected):
                problems.append("the final checkpoint differs from the undisrupted job's")
        rounds.append({"disruptions": len(done), "problems": problems})
        print(f"round {len(rounds)}: {len(done)} disruptions, problems: {problems or 'none'}")
        if unfinished:
            break  # the job cannot go on: the soak reports it rather than start it again
    kinds = Counter(f"{d['kind']} {d['target']}" for d in disruptions)
    orphans = [o for d in disruptions for o in d["orphans"]]
    minutes = (time.monotonic() - started) / 60
    troubled = sum(bool(r["problems"]) for r in rounds)
    print(f"{len(disruptions)} disruptions in {len(rounds)} rounds, {minutes:.0f} min: {kinds}")
    print(f"orphans left: {len(orphans)}; rounds with problems: {troubled}")
    path = RESULTS / "chaos_soak.json"
    summary = {"machine": machine(), "args": vars(args), "minutes": round(minutes, 1)}
    path.write_text(
        json.dumps({**summary, "kinds": kinds, "orphans": orphans, "rounds": rounds,
                    "disruptions": disruptions}, indent=2) + "\n"
    )  # fmt: skip
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
