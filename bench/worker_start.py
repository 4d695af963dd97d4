"""Loader workers from a fork server against workers forked from the training process: the time
to a run's first step and to its first evaluation's first batch, and each worker's memory on a
1.28-million-sample folder index (ImageNet's train set), which a fork server's workers get
pickled rather than shared by the fork.

    python -m bench.worker_start [--repeats 3]

Start-up: `ddptrain train` of resnet18 on a small generated folder (32 px, `-b 16`, `-j 2`,
one epoch, 8 steps), in a fresh process each time, the two kinds alternating; "fork" is the
same code with the fork server replaced by the fork context (the loaders as they were). Times
are from the process's start to its first train batch (its first step) and to its first
evaluation's first batch.
Memory: two workers of a loader over 1,281,167 ImageNet-like (path, class) samples whose
images are never read, kept as a list (torchvision's ImageFolder) or compact (ddptrain's,
folder.Samples), each worker's unique and proportional memory (USS, PSS, from
/proc/PID/smaps_rollup) after a few batches and once it read its share of an epoch in a random
order. Writes bench/results/worker_start.json.
"""

import argparse
import json
import multiprocessing
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from bench.common import RESULTS, machine, python

SAMPLES = 1_281_167  # ImageNet-1k's train set


def _smaps(pid: int) -> dict[str, float]:
    """USS, PSS and RSS of pid, in MiB."""
    fields = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        name, value = line.split(":")
        fields[name] = int(value.split()[0]) / 1024
    uss = fields["Private_Clean"] + fields["Private_Dirty"]
    return {"uss": round(uss, 1), "pss": round(fields["Pss"], 1), "rss": round(fields["Rss"], 1)}


def use_fork() -> None:
    """The loaders as they were: workers forked from the process that runs them."""
    from ddptrain.data import fork_server

    fork_server.CONTEXT = multiprocessing.get_context("fork")
    fork_server.start = lambda: None


# Run as the CLI runs (the fork server started before torch is imported), with the loaders'
# first batches timed; "fork" swaps the fork server for the fork context first.
TIMED_CLI = """
import json, multiprocessing, sys, time
from ddptrain.data import fork_server
if sys.argv[1] == "fork":  # as use_fork, without importing bench (and so torch) first
    fork_server.CONTEXT = multiprocessing.get_context("fork")
    fork_server.start = lambda: None
else:
    fork_server.start()
from ddptrain.data import workers
from ddptrain.cli import main

seen, plain_iter = {}, workers.Loader.__iter__

def timed_iter(loader):
    which = "train" if type(loader.dataset).__name__ == "SeededSamples" else "val"
    for batch in plain_iter(loader):
        seen.setdefault(which, time.time())
        yield batch

workers.Loader.__iter__ = timed_iter
code = main(sys.argv[3:])
with open(sys.argv[2], "w") as out:
    json.dump(seen, out)
sys.exit(code)
"""


def one_start(kind: str, data: str) -> dict:
    """`ddptrain train` in a fresh process: seconds from its start to its first train batch and
    to its first evaluation's first batch."""
    flags = ("--image-size", "32", "-b", "16", "-j", "2", "--epochs", "1", "--seed", "0")
    with tempfile.TemporaryDirectory() as out:
        times = Path(out) / "times.json"
        argv = ["train", data, *flags, "--progress", "none", "--out-dir", f"{out}/run"]
        started = time.time()
        subprocess.run(
            python("-c", TIMED_CLI, kind, str(times), *argv), check=True, capture_output=True
        )
        return {which: at - started for which, at in json.loads(times.read_text()).items()}


def startup(repeats: int, data: str) -> dict:
    runs = {"fork": [], "forkserver": []}
    for _ in range(repeats):
        for kind in runs:
            runs[kind].append(one_start(kind, data))
    return {
        kind: {
            "runs": found,
            **{f"{what}_s": statistics.median(r[what] for r in found) for what in ("train", "val")},
        }
        for kind, found in runs.items()
    }


def listed(count: int) -> list[tuple[str, int]]:
    """ImageNet-like (path, class index) pairs."""
    return [
        (f"/data/imagenet/train/n{i % 1000:08d}/n{i % 1000:08d}_{i}.JPEG", i % 1000)
        for i in range(count)
    ]


class Listed:
    """An image folder's samples, never read: a batch is the samples' labels. `compact`: kept
    as ddptrain's ImageFolder keeps them (folder.Samples), else as a list, as torchvision's."""

    def __init__(self, count: int, compact: bool):
        from ddptrain.data.folder import Samples

        self.samples = Samples(listed(count)) if compact else listed(count)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> int:
        return self.samples[index][1]


KINDS = {  # loader kind: (workers forked from this process, samples kept compact)
    "fork, list": (True, False),
    "fork server, list": (False, False),
    "fork server, compact": (False, True),
}


def memory(kind: str) -> dict:
    """Each worker's memory once it served a few batches and after an epoch, over a
    1.28-million-sample list."""
    forked, compact = KINDS[kind]
    if forked:
        use_fork()
    from ddptrain.data.workers import Loader

    loader = Loader(Listed(SAMPLES, compact), batch_size=1024, num_workers=2, shuffle=True)
    batches = iter(loader)
    for _ in range(4):
        next(batches)
    found = {f"worker{i} at its start": _smaps(w.pid) for i, w in enumerate(batches._workers)}
    for _ in batches:  # every sample read once, in a random order, as an epoch reads them
        if batches._send_idx >= len(loader) - 2 * loader.prefetch_factor:
            after = {
                f"worker{i} after an epoch": _smaps(w.pid) for i, w in enumerate(batches._workers)
            }
            found.update(after)
            break
    del batches
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--memory", metavar="KIND")
    args = parser.parse_args()
    if args.memory:
        print(json.dumps(memory(args.memory)))
        return
    from ddptrain.data.synth import SynthSpec, write

    with tempfile.TemporaryDirectory() as folder:
        spec = SynthSpec(classes=4, train_per_class=32, val_per_class=8, size=40, seed=0)
        data = str(write(spec, Path(folder) / "data"))
        times = startup(args.repeats, data)
    memories = {}
    for kind in KINDS:
        result = subprocess.run(
            python("-m", "bench.worker_start", "--memory", kind),
            capture_output=True,
            text=True,
            check=True,
        )
        memories[kind] = json.loads(result.stdout.strip().splitlines()[-1])
    for kind, took in times.items():
        print(
            f"{kind:>10}: first step {took['train_s']:.2f} s, first evaluation's first batch "
            f"{took['val_s']:.2f} s (medians of {args.repeats})"
        )
    for kind, found in memories.items():
        shown = (f"{at}: USS {m['uss']:.0f} MiB (PSS {m['pss']:.0f})" for at, m in found.items())
        print(f"{kind}: {', '.join(shown)}")
    path = RESULTS / "worker_start.json"
    path.write_text(
        json.dumps({"machine": machine(), "startup": times, "memory_mib": memories}, indent=2)
        + "\n"
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
