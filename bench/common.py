"""What every benchmark shares: the generated JPEG set, repeats, subprocesses, the table and
the results files."""

import contextlib
import json
import multiprocessing
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw

REPO = Path(__file__).resolve().parent.parent
# Generated data and --quick results (a test points it elsewhere).
CACHE = Path(os.environ.get("DDPTRAIN_BENCH_CACHE", REPO / "bench" / ".data"))
RESULTS = REPO / "bench" / "results"


@dataclass(frozen=True)
class Scale:
    """The sizes of a full run, or of a --quick smoke check."""

    classes: int = 4
    train_per_class: int = 128
    val_per_class: int = 16
    width: int = 500
    height: int = 375
    image_size: int = 224
    batch: int = 32
    repeats: int = 3
    tries: int = 4  # per run, while other work disturbs it


FULL = Scale()
QUICK = Scale(
    train_per_class=8,
    val_per_class=2,
    width=160,
    height=120,
    image_size=64,
    batch=8,
    repeats=1,
    tries=1,
)


def scale(quick: bool) -> Scale:
    return QUICK if quick else FULL


def photo(rng: np.random.Generator, width: int, height: int) -> Image.Image:
    """A photo-like image: smooth colour fields at three scales, a few hard-edged shapes and
    sensor-like noise; as a quality-90 JPEG about as dense as ImageNet's (~90 KB at 500x375)."""
    pixels = np.full((height, width, 3), 128, np.float32)
    for cells, amplitude in ((3, 90), (12, 40), (48, 18)):
        small = rng.integers(0, 256, (cells * 3 // 4 + 1, cells + 1, 3), dtype=np.uint8)
        field = Image.fromarray(small).resize((width, height), Image.BICUBIC)
        pixels += (np.asarray(field, np.float32) - 128) * amplitude / 128
    image = Image.fromarray(pixels.clip(0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(image)
    for _ in range(rng.integers(4, 10)):
        x, y = rng.integers(0, width), rng.integers(0, height)
        box = (
            x,
            y,
            x + rng.integers(width // 25, width // 2),
            y + rng.integers(height // 20, height // 2),
        )
        fill = tuple(int(c) for c in rng.integers(0, 256, 3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)(box, fill=fill)
    noisy = np.asarray(image, np.float32) + rng.normal(0, 16, (height, width, 3))
    return Image.fromarray(noisy.clip(0, 255).astype(np.uint8))


def _write_photo(job: tuple[Path, tuple[int, ...], int, int]) -> None:
    path, seed, width, height = job
    photo(np.random.default_rng(seed), width, height).save(path, quality=90)


def jpeg_folder(s: Scale, processes: int = 1) -> Path:
    """The ImageFolder tree for scale s, generated once into bench/.data (train/ and val/).
    Each image has its own seed, so the tree is the same with any number of processes."""
    root = CACHE / f"jpeg-{s.classes}x{s.train_per_class}-{s.width}x{s.height}"
    if (root / "done").exists():
        return root
    jobs = []
    for split, count in (("train", s.train_per_class), ("val", s.val_per_class)):
        for c in range(s.classes):
            folder = root / split / f"class{c}"
            folder.mkdir(parents=True, exist_ok=True)
            seeds = ((len(split), c, i) for i in range(count))
            jobs += [
                (folder / f"{i:04d}.jpg", seed, s.width, s.height) for i, seed in enumerate(seeds)
            ]
    if processes > 1:
        with multiprocessing.Pool(processes) as pool:
            pool.map(_write_photo, jobs, chunksize=16)
    else:
        for job in jobs:
            _write_photo(job)
    (root / "done").touch()
    return root


def subprocess_env(**extra: str) -> dict:
    """This checkout's ddptrain first on the path; launcher warnings off."""
    path = os.pathsep.join(p for p in (str(REPO / "src"), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "PYTHONWARNINGS": "ignore"}
    # Each contender picks its own threads (torch's default, ddptrain's rule) unless extra says.
    env.pop("OMP_NUM_THREADS", None)
    return {**env, **extra}


def run(cmd: list[str], env: dict, timeout: float = 900) -> str:
    """Runs cmd from the repo root; returns its stdout, or raises with the tail of its stderr."""
    done = subprocess.run(
        cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    if done.returncode != 0:
        raise _failed(cmd, done.returncode, done.stderr)
    return done.stdout


def _failed(cmd: list[str], code: int, stderr: str) -> RuntimeError:
    return RuntimeError(f"{' '.join(cmd)} failed ({code}):\n{stderr[-3000:]}")


def tree_cpu(pid: int) -> dict[str, float]:
    """CPU seconds so far of process pid and its descendants, summed by process name (torch
    names the loader's worker processes pt_data_worker). Linux /proc; {} elsewhere."""
    tick, seconds = os.sysconf("SC_CLK_TCK"), {}
    pending = [pid]
    while pending:
        proc = Path(f"/proc/{pending.pop()}")
        try:
            stat = (proc / "stat").read_text()
        except OSError:  # gone meanwhile
            continue
        name, fields = stat[stat.index("(") + 1 : stat.rindex(")")], stat.rsplit(")", 1)[1].split()
        # utime and stime, fields 14 and 15 of proc(5), counted after the name's field 2
        seconds[name] = seconds.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
        for task in proc.glob("task/*"):
            with contextlib.suppress(OSError):  # a thread gone, or a kernel without the file
                pending += [int(child) for child in (task / "children").read_text().split()]
    return seconds


def run_marking_cpu(
    cmd: list[str], env: dict, marks: list[str], timeout: float = 900
) -> list[tuple[float, dict[str, float]] | None]:
    """Runs cmd like `run`, and for each of `marks` takes (seconds since the start, tree_cpu)
    at the first poll, every 0.1 s, that finds the mark in cmd's output (None if it never came).
    cmd should flush its lines as it writes them."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=err, text=True)
        taken: list = [None] * len(marks)
        while proc.poll() is None:
            if time.perf_counter() - start > timeout:
                proc.kill()
                raise RuntimeError(f"{' '.join(cmd)} ran past {timeout} s")
            out.seek(0)
            written = out.read()
            for i, mark in enumerate(marks):
                if taken[i] is None and mark in written:
                    taken[i] = (time.perf_counter() - start, tree_cpu(proc.pid))
            time.sleep(0.1)
        if proc.returncode != 0:
            err.seek(0)
            raise _failed(cmd, proc.returncode, err.read())
    return taken


def run_json(cmd: list[str], env: dict, timeout: float = 900) -> dict:
    """Runs cmd and returns the JSON object on the last line of its output."""
    return json.loads(run(cmd, env, timeout).strip().splitlines()[-1])


def _busy_seconds() -> float:
    """CPU seconds all processes have spent busy since boot (Linux; 0 elsewhere)."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except OSError:
        return 0.0
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def cpu_seconds(*whose: int) -> float:
    """CPU seconds of `whose` (resource.RUSAGE_SELF: this process, all its threads;
    RUSAGE_CHILDREN: its finished children, and theirs)."""
    return sum(u.ru_utime + u.ru_stime for u in map(resource.getrusage, whose))


def _own_seconds() -> float:
    """CPU seconds of this process and of its finished children (and theirs)."""
    return cpu_seconds(resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)


def wait_for_quiet(limit: float = 300, busy: float = 0.1) -> bool:
    """Waits (up to `limit` s) until other work leaves the cores idle for a second."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        before = _busy_seconds()
        time.sleep(1.0)
        if _busy_seconds() - before < busy:
            return True
    return False


def undisturbed(measure, tries: int = 4, limit: float = 0.15) -> tuple[float, float]:
    """measure() on a machine other work leaves alone: returns (its value, the cores other
    processes kept busy meanwhile), retrying while that exceeds `limit` (a shared machine).
    With one try (--quick), it neither waits nor retries."""
    for _ in range(tries):
        if tries > 1:
            wait_for_quiet()
        busy, own, start = _busy_seconds(), _own_seconds(), time.perf_counter()
        value = measure()
        wall = time.perf_counter() - start
        foreign = max(0.0, (_busy_seconds() - busy) - (_own_seconds() - own)) / wall
        if foreign <= limit:
            break
        print(f"  (other work took {foreign:.2f} cores meanwhile: measuring again)", flush=True)
    return value, round(foreign, 3)


def compare(contenders: dict, s: Scale, unit: str) -> list[dict]:
    """Each contender s.repeats times, alternating, each run undisturbed; rows with medians."""
    runs = {name: [] for name in contenders}
    foreign = {name: [] for name in contenders}
    for repeat in range(s.repeats):
        for name, measure in contenders.items():
            value, cores = undisturbed(measure, tries=s.tries)
            runs[name].append(round(value, 2))
            foreign[name].append(cores)
            print(f"  run {repeat + 1}/{s.repeats}: {name}: {value:.1f} {unit}", flush=True)
    return [measured(name, runs[name], unit, foreign[name]) for name in contenders]


def python(*args: str) -> list[str]:
    return [sys.executable, *args]


def median(values: list[float]) -> float:
    return statistics.median(values)


def ratio_row(
    name: str,
    value: float,
    target: float | None,
    op: str = ">=",
    runs: list[float] | None = None,
    stretch: float | None = None,
) -> dict:
    """A ratio and whether it meets its target (None: shown for reference only): at least
    (">=") or at most ("<=") the target, or "within" the target of 1 (a prediction against
    what was measured). `runs`: the ratio of each repeat (its contenders measured side by side
    in that repeat); then `value` is their median and the row keeps their spread. `stretch`: a
    further target beyond `target`, shown with it."""
    checks = {">=": lambda v, t: v >= t, "<=": lambda v, t: v <= t,
              "within": lambda v, t: abs(v - 1) <= t}  # fmt: skip
    met = None if target is None else checks[op](value, target)
    row = {"name": name, "ratio": round(value, 3), "target": target, "op": op, "met": met}
    if runs is not None:
        row.update(spread(runs, digits=3))
    if stretch is not None:
        row.update(stretch=stretch, stretch_met=checks[op](value, stretch))
    return row


def spread(runs: list[float], digits: int = 2) -> dict:
    """The runs, their min and max, and max - min as a share of their median."""
    mid = median(runs)
    return {
        "runs": [round(v, digits) for v in runs],
        "min": round(min(runs), digits),
        "max": round(max(runs), digits),
        "spread": round((max(runs) - min(runs)) / mid, 3) if mid else None,
    }


def paired(rows: list[dict], formula) -> list[float]:
    """A ratio per repeat: `formula` applied to each repeat's values, a dict by row name (the
    contenders of one repeat ran side by side, alternating)."""
    by_name = {r["name"]: r["runs"] for r in rows}
    repeats = min(len(v) for v in by_name.values())
    return [formula({n: v[i] for n, v in by_name.items()}) for i in range(repeats)]


def paired_ratio(name: str, rows: list[dict], formula, target: float | None, **kwargs) -> dict:
    """ratio_row of the per-repeat ratios `formula` gives: their median, min and max."""
    runs = paired(rows, formula)
    return ratio_row(name, median(runs), target, runs=runs, **kwargs)


def target_text(r: dict) -> str:
    """A ratio row's target in words ("" for a reference row)."""
    if r["target"] is None:
        return ""
    op = r.get("op", ">=")
    if op == "within":
        return f"target 1 +- {r['target']}x"
    return f"target {op} {r['target']}x"


def _range(r: dict, fmt: str) -> str:
    if "min" not in r:
        return ""
    return f"{r['min']:{fmt}}-{r['max']:{fmt}}, spread {100 * (r['spread'] or 0):.0f}%"


def print_table(title: str, rows: list[dict], ratios: list[dict]) -> None:
    """Medians with their min-max and spread ((max - min) / median) over the repeats."""
    print(f"\n{title}")
    width = max(len(r["name"]) for r in rows + ratios)
    for r in rows:
        runs = ", ".join(f"{v:.1f}" for v in r["runs"])
        print(
            f"  {r['name']:<{width}}  {r['median']:9.1f} {r['unit']}"
            f"  (min-max {_range(r, '.1f')}; runs: {runs})"
        )
    for r in ratios:
        verdict = "met" if r["met"] else "NOT met"
        note = "reference" if r["target"] is None else f"{target_text(r)}: {verdict}"
        if r.get("stretch") is not None:
            note += f"; stretch {r['stretch']}x: {'met' if r['stretch_met'] else 'NOT met'}"
        span = f"  [min-max {_range(r, '.2f')}]" if "min" in r else ""
        print(f"  {r['name']:<{width}}  {r['ratio']:9.2f}x{span}  ({note})")


def measured(name: str, runs: list[float], unit: str, foreign: list[float]) -> dict:
    """A contender's runs and median; `foreign`: cores other processes used during each run."""
    return {
        "name": name,
        "median": round(median(runs), 2),
        **spread(runs),
        "unit": unit,
        "foreign_cores": foreign,
    }


# The CPU flags the kernels' speed depends on (the full list is long).
SIMD_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx512_fp16",
              "amx_tile", "amx_bf16", "amx_int8", "asimd", "sve", "bf16")  # fmt: skip


def descendants(pid: int) -> list[int]:
    """Every process below pid, parents before their children (Linux's /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        below = children.get(todo.pop(0), [])
        found += below
        todo += below
    return found


def machine() -> dict:
    """What the figures were measured on."""
    try:
        info = dict(
            line.split(":", 1)
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if ":" in line
        )
    except OSError:
        info = {}
    info = {k.strip(): v.strip() for k, v in info.items()}  # the last core's entries
    flags = info.get("flags", "").split()
    return {
        "cpu": info.get("model name", platform.processor()),
        "bf16_isa": [f for f in ("amx_bf16", "avx512_bf16") if f in flags],
        "simd_flags": [f for f in SIMD_FLAGS if f in flags],
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "mkldnn_bf16_supported": bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch": torch.__version__,
        "cuda": torch.cuda.is_available(),
    }


def native_amp() -> str:
    """The amp a bench runs by default: bf16 where the CPU computes bf16 in hardware
    (avx512_bf16, AMX), else none (fp32). oneDNN's own check
    (torch.ops.mkldnn._is_mkldnn_bf16_supported) also answers yes for plain AVX-512, where
    bf16 is emulated and slower than fp32."""
    return "bf16" if machine()["bf16_isa"] else "none"


def write_results(name: str, quick: bool, settings: dict, rows: list, ratios: list) -> Path:
    """bench/results/NAME.json (a --quick run writes under bench/.data, never over results)."""
    folder = CACHE / "results-quick" if quick else RESULTS
    folder.mkdir(parents=True, exist_ok=True)
    payload = {
        "bench": name,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": machine(),
        "settings": settings,
        "measured": rows,
        "ratios": ratios,
    }
    path = folder / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path
