"""`ddptrain plan`: what each rank of a run will hold under ddp and under fsdp, before it starts,
and which strategy fits the device.

The figures come from a real trace of one training step on fake tensors (`tools/trace.py`), run
in a child process so that its fake process group never meets a real run. `plan_line` gives a
starting run its own strategy's line, and on a device too small, the strategy or batch that fits.
"""

import contextlib
import dataclasses
import functools
import hashlib
import importlib.metadata
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import ddptrain
from ddptrain.config import (
    MEMORY_SETTINGS,
    Config,
    ModelSettings,
    OptimSettings,
    ParallelSettings,
)
from ddptrain.data.synth import cache_dir
from ddptrain.errors import UserError
from ddptrain.state.files import atomic_write

STRATEGIES = ("ddp", "fsdp")
GiB = 2**30
# The share of a device's memory a plan lets the run take. Not traced: the CUDA context, cuDNN and
# cuBLAS workspaces, NCCL's own buffers, and the caching allocator's rounding and fragmentation.
USABLE = 0.9
TRACE_TIMEOUT = 900  # seconds; a trace usually takes a few (docs/strategies.md)
BATCH_SEARCH_TRACES = 4  # traces spent looking for the largest batch that fits
# Launcher variables a child of a real rank must not see (it plans; it joins no job).
LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK")
LAUNCHER_ENV_PREFIXES = ("MASTER_", "TORCHELASTIC_", "TORCH_NCCL_")


@dataclass(frozen=True, kw_only=True)
class MemorySettings:
    """The run's settings that change what a rank holds (config.MEMORY_SETTINGS), by default
    train's: a Workload's, and flags of `ddptrain plan`."""

    opt: str = OptimSettings.opt
    momentum: float = OptimSettings.momentum  # SGD keeps no state without it
    model_ema: bool = OptimSettings.model_ema
    accum_steps: int = OptimSettings.accum_steps  # forward passes the per-rank batch is split into
    reshard_after_forward: bool = ParallelSettings.reshard_after_forward  # fsdp's
    freeze_backbone: bool = OptimSettings.freeze_backbone  # for the whole run: the head trains
    grad_checkpointing: bool = ModelSettings.grad_checkpointing


@dataclass(frozen=True)
class Workload(MemorySettings):
    """What one traced step is: the model, the images each rank takes in it, and the run's
    settings that change what a rank holds."""

    arch: str
    num_classes: int
    world_size: int
    per_rank_batch: int
    image_size: int
    amp: str

    @property
    def forward_batch(self) -> int:
        return self.per_rank_batch // self.accum_steps

    def with_batch(self, per_rank_batch: int) -> "Workload":
        return dataclasses.replace(self, per_rank_batch=per_rank_batch)


@dataclass(frozen=True)
class PlanRequest(MemorySettings):
    """`ddptrain plan`'s flags, checked as `ddptrain train` checks the same ones."""

    arch: str
    world_size: int = 1
    batch_size: int = 256  # global, as for train
    image_size: int = 224
    amp: str = "none"
    num_classes: int = 1000
    device_memory: float | None = None  # GiB; None: the CUDA device's, if there is one
    json: bool = False

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise UserError(f"--world-size must be at least 1, got {self.world_size}")
        if self.num_classes < 1:
            raise UserError(f"--num-classes must be at least 1, got {self.num_classes}")
        if self.amp == "auto":  # it resolves on the device of the run, which plan may not be
            raise UserError(
                "--amp auto: plan needs the precision the run will take: --amp none, bf16 or fp16"
            )
        if self.device_memory is not None and not 0 < self.device_memory < math.inf:
            raise UserError(
                f"--device-memory must be a positive number (GiB), got {self.device_memory}"
            )
        config = Config(
            arch=self.arch, batch_size=self.batch_size, image_size=self.image_size, amp=self.amp,
            strategy="fsdp",  # which takes all of MEMORY_SETTINGS; ddp ignores its own
            **{name: getattr(self, name) for name in MEMORY_SETTINGS},
        )  # fmt: skip
        config.check_batch_divides(self.world_size)

    @property
    def per_rank_batch(self) -> int:
        return self.batch_size // self.world_size

    @property
    def workload(self) -> Workload:
        return Workload(
            self.arch,
            self.num_classes,
            self.world_size,
            self.per_rank_batch,
            self.image_size,
            self.amp,
            **{name: getattr(self, name) for name in MEMORY_SETTINGS},
        )


def trace(
    workload: Workload, strategies: tuple[str, ...] = STRATEGIES, deadline: float | None = None
) -> dict[str, dict]:
    """Per-rank bytes of one training step under each strategy (see tools/trace.py), traced in a
    child process, or as this same code traced the same request before (every starting run
    asks, and a trace takes seconds). A trace not done by `deadline` (time.monotonic) fails."""
    request = {**dataclasses.asdict(workload), "strategies": list(strategies)}
    remembered = _remembered_file(request)
    with contextlib.suppress(OSError, ValueError):
        result = json.loads(remembered.read_text())
        if _complete(result, strategies):
            return result
    result = _trace_in_child(request, deadline)
    # A cache that cannot be written costs the next run a trace, nothing more.
    with contextlib.suppress(OSError):
        remembered.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(remembered, json.dumps(result).encode())
    return result


def _remembered_file(request: dict) -> Path:
    """Where a trace of `request` is kept: named by the request, torch's and torchvision's
    versions and this package's source, any change to which traces again."""
    key = hashlib.sha256(json.dumps(request, sort_keys=True).encode() + _code_version())
    return cache_dir() / "plans" / f"{key.hexdigest()[:32]}.json"


@functools.cache
def _code_version() -> bytes:
    """A digest of what a trace depends on besides its request: torch's and torchvision's
    versions and this package's source. Once per process: a plan may trace several times."""
    digest = hashlib.sha256()
    for package in ("torch", "torchvision"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):  # a source build
            digest.update(importlib.metadata.version(package).encode())
    for source in sorted(Path(ddptrain.__file__).parent.rglob("*.py")):
        digest.update(source.read_bytes())
    return digest.digest()


def _complete(result: object, strategies: tuple[str, ...]) -> bool:
    """Whether a kept trace holds every figure the plan reads, for each strategy asked."""
    return (
        isinstance(result, dict)
        and set(result) == set(strategies)
        and all(isinstance(result[s], dict) and result[s].keys() >= FIGURES for s in strategies)
    )


def _trace_in_child(request: dict, deadline: float | None) -> dict[str, dict]:
    left = TRACE_TIMEOUT if deadline is None else deadline - time.monotonic()
    timeout = max(0.0, min(TRACE_TIMEOUT, left))
    with tempfile.TemporaryDirectory(prefix="ddptrain-plan-") as folder:
        reply = Path(folder) / "reply.json"  # not stdout, where a library may print too
        command = [sys.executable, "-m", "ddptrain.tools.trace", json.dumps(request), str(reply)]
        try:
            done = subprocess.run(
                command, env=_child_env(), capture_output=True, text=True, timeout=timeout
            )
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"the memory trace took longer than {timeout:.0f} s") from None
        result = json.loads(reply.read_text()) if reply.is_file() else {}
    if "error" in result:
        raise UserError(f"--arch {request['arch']}: {result['error']}")
    if done.returncode != 0 or not result:
        raise RuntimeError(f"the memory trace failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return result


def _child_env() -> dict[str, str]:
    """This ddptrain first on the path; one thread (fake tensors compute nothing); no GPU and no
    launcher variables, so the child cannot touch the devices or the job of a run it plans."""
    root = str(Path(ddptrain.__file__).resolve().parents[1])
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in LAUNCHER_ENV and not k.startswith(LAUNCHER_ENV_PREFIXES)
    }
    path = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return {**env, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}


def cuda_memory() -> int | None:
    """The bytes of this process's CUDA device, or None without one."""
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory


def largest_batch(
    workload: Workload,
    strategy: str,
    usable: int,
    figures: dict,
    deadline: float | None = None,
) -> int | None:
    """The largest per-rank batch below the workload's whose peak fits `usable` bytes, or None
    when not even one image per forward pass does; under --accum-steps a multiple of it, as
    the run's batch must be. `figures`: the workload's trace. The peak grows almost linearly
    with the images of one forward: a secant search from the traced forward, each guess traced
    (at most BATCH_SEARCH_TRACES of them)."""
    forwards, batch = workload.accum_steps, workload.forward_batch
    fixed = sum(figures[k] for k in ("params", "grads", "optimizer", "ema", "buffers"))
    fixed += figures["all_gather_peak"] or 0
    if (figures["bucket_rebuild"] or 0) > usable or fixed >= usable:
        return None
    fits, fails = 0, batch
    known = (batch, figures["peak"])
    slope = max(1.0, (figures["peak"] - fixed) / batch)
    guess = int((usable - fixed) / slope)
    for _ in range(BATCH_SEARCH_TRACES):
        guess = min(max(guess, fits + 1), fails - 1)
        if guess <= fits:
            break
        peak = _traced_peak(workload.with_batch(guess * forwards), strategy, deadline)
        if peak is None:  # no answer, but no bound either (BatchNorm refuses 1, takes 2)
            guess += 1
            continue
        if peak <= usable:
            fits = guess
        else:
            fails = guess
        slope = max(1.0, (known[1] - peak) / (known[0] - guess))
        known = (guess, peak)
        guess = guess + int((usable - peak) // slope)
    return fits * forwards or None


def _traced_peak(workload: Workload, strategy: str, deadline: float | None) -> int | None:
    """The peak of a workload traced while looking for one that fits, or None where it does not
    trace (a model that cannot train on one image per forward pass: BatchNorm) or the time is
    up: not an answer, and the advice already found stands."""
    try:
        return trace(workload, (strategy,), deadline)[strategy]["peak"]
    except (UserError, RuntimeError):
        return None


def plan(request: PlanRequest) -> dict[str, dict]:
    """Both strategies' figures, each with whether it fits the device and, if not, the largest
    global batch that would (None: not even 1 per forward pass)."""
    result = trace(request.workload, STRATEGIES)
    device = cuda_memory() if request.device_memory is None else int(request.device_memory * GiB)
    for strategy, figures in result.items():
        usable = None if device is None else int(device * USABLE)
        fits = None if usable is None else figures["peak"] <= usable
        figures.update(device_memory=device, usable_memory=usable, fits=fits, fitting_batch=None)
        if fits is False:
            per_rank = largest_batch(request.workload, strategy, usable, figures)
            figures["fitting_batch"] = per_rank and per_rank * request.world_size
    return result


def size(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, scale in (("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            value = n / scale
            digits = 0 if value >= 100 else 1 if value >= 10 else 2  # three significant digits
            return f"{value:.{digits}f} {unit}"
    return f"{n} B"


ROWS = (
    ("parameters", "params"),
    ("gradients", "grads"),
    ("optimizer state", "optimizer"),
    ("EMA weights (--model-ema)", "ema"),
    ("buffers", "buffers"),
    ("activations", "activations"),
    ("input batch", "inputs"),
    ("communication buffers", "comm_buffers"),
    ("all-gather peak", "all_gather_peak"),
    ("DDP bucket rebuild", "bucket_rebuild"),
    ("peak", "peak"),
)
FIGURES = {key for _, key in ROWS}  # what the plan reads of a trace, per strategy


def table(request: PlanRequest, result: dict[str, dict]) -> str:
    r = request
    per_rank = f"{r.per_rank_batch} per rank"
    if r.accum_steps > 1:
        per_rank += f" in {r.accum_steps} forward passes of {r.workload.forward_batch}"
    lines = [
        f"ddptrain plan: {r.arch} on {r.world_size} rank(s), global batch {r.batch_size} "
        f"({per_rank}), {r.image_size} px, amp {r.amp}, {r.num_classes} classes, --opt {r.opt}"
        + (", --model-ema" if r.model_ema else "")
        + (", --freeze-backbone" if r.freeze_backbone else "")
        + (", --grad-checkpointing" if r.grad_checkpointing else ""),
        f"  {'per rank':<30}{'ddp':>12}{'fsdp':>12}",
    ]
    for label, key in ROWS:
        lines.append(f"  {label:<30}" + "".join(f"{size(result[s][key]):>12}" for s in STRATEGIES))
    device = result["ddp"]["device_memory"]
    if device is not None:
        label = f"fits {size(device)} ({size(result['ddp']['usable_memory'])} usable)"
        marks = ["yes" if result[s]["fits"] else "no" for s in STRATEGIES]
        lines.append(f"  {label:<30}" + "".join(f"{m:>12}" for m in marks))
    lines += [
        "  ddp: its buckets hold the gradients themselves (gradient_as_bucket_view), so they add",
        "    nothing, but before training DDP rebuilds them and holds old and new at once.",
        "  fsdp: communication buffers are the all-gather and reduce-scatter buffers at their",
        "    largest; all-gather peak, the gathered parameters held at once.",
        "  Not traced: CUDA context, library workspaces, NCCL buffers, allocator fragmentation",
        f"    ({100 - round(USABLE * 100)}% of the device is left for them).",
        verdict(request, result),
    ]
    return "\n".join(lines)


def verdict(request: PlanRequest, result: dict[str, dict]) -> str:
    ddp, fsdp = result["ddp"], result["fsdp"]
    if ddp["fits"] is None:
        return "No device to compare with: --device-memory GiB says which strategy fits."
    room = size(ddp["device_memory"])
    if ddp["fits"] and fsdp["fits"]:
        return (
            f"Both fit {room}: ddp is the faster (no parameter all-gathers); fsdp leaves more "
            "room for a larger batch."
        )
    if fsdp["fits"] or ddp["fits"]:
        strategy = "fsdp" if fsdp["fits"] else "ddp"
        return f"Only {strategy} fits {room}: train with --strategy {strategy}."

    def batch(s: str) -> str:
        b = result[s]["fitting_batch"]
        return f"{s} fits -b {b}" if b else f"{s} not even at {_least(request.workload)}"

    return (
        f"Neither fits {room} at -b {request.batch_size}: {batch('ddp')}, {batch('fsdp')}"
        " (more ranks shard fsdp's model state further)."
    )


def answer(request: PlanRequest) -> str:
    """What `ddptrain plan` prints: the table, or with --json the figures as one object."""
    result = plan(request)
    return json.dumps(result) if request.json else table(request, result)


def plan_line(
    workload: Workload,
    strategy: str,
    device_memory_bytes: int | None,
    seconds: float = TRACE_TIMEOUT,
) -> str:
    """One line for a starting run's rank 0: its strategy's per-rank peak; given the device's
    bytes (CUDA), whether it fits, and when not, the other strategy or the global batch that
    would. A trace in a child process: seconds, more when it does not fit and alternatives are
    traced; all of them within `seconds`, or it fails."""
    deadline = time.monotonic() + seconds
    figures = trace(workload, (strategy,), deadline)[strategy]
    state = sum(figures[k] for k in ("params", "grads", "optimizer", "ema"))
    per_rank = f"{workload.per_rank_batch} per rank"
    if workload.accum_steps > 1:
        per_rank += f" ({workload.forward_batch} per forward)"
    ema = f" with the EMA's {size(figures['ema'])}" if figures["ema"] else ""
    line = (
        f"plan: {strategy}, {per_rank}: peak {size(figures['peak'])} per rank "
        f"(model state {size(state)}{ema}, activations {size(figures['activations'])})"
    )
    if device_memory_bytes is None:
        return line
    usable = int(device_memory_bytes * USABLE)
    room = f"{size(device_memory_bytes)} ({size(usable)} usable)"
    if figures["peak"] <= usable:
        return f"{line}; fits {room}"
    other = "fsdp" if strategy == "ddp" else "ddp"
    other_peak = _traced_peak(workload, other, deadline)
    if other_peak is not None and other_peak <= usable:
        return f"{line}; will NOT fit {room}: --strategy {other} would (peak {size(other_peak)})"
    fitting = largest_batch(workload, strategy, usable, figures, deadline)
    if fitting is None:
        return (
            f"{line}; will NOT fit {room}, not even at {_least(workload)}: more ranks with "
            "--strategy fsdp shard the model state further"
        )
    advice = f"-b {fitting * workload.world_size} would ({fitting} per rank)"
    split = _accumulation_that_fits(workload, strategy, usable, fitting, deadline)
    if split:
        advice += (
            f", or --accum-steps {split} at -b {workload.per_rank_batch * workload.world_size}"
        )
    return f"{line}; will NOT fit {room}: {advice}"


def _accumulation_that_fits(
    workload: Workload, strategy: str, usable: int, fitting: int, deadline: float
) -> int | None:
    """The fewest forward passes that take the run's per-rank batch within `usable` bytes,
    which keeps its -b and so its optimizer steps (a recipe's LR and schedule), or None.
    `fitting`: the largest per-rank batch that fits at the run's --accum-steps. Each split is
    traced, as accumulating holds gradients of its own (tools/trace.py); two at most, from the
    first whose forward pass is no larger than those of `fitting`."""
    per_rank, largest_forward = workload.per_rank_batch, fitting // workload.accum_steps
    splits = range(workload.accum_steps + 1, per_rank + 1)
    small_enough = [k for k in splits if per_rank % k == 0 and per_rank // k <= largest_forward]
    for split in small_enough[:2]:
        peak = _traced_peak(dataclasses.replace(workload, accum_steps=split), strategy, deadline)
        if peak is not None and peak <= usable:
            return split
    return None


def _least(workload: Workload) -> str:
    """The smallest batch a rank can take at the workload's --accum-steps."""
    if workload.accum_steps == 1:
        return "1 image per rank"
    return f"1 image per forward pass ({workload.accum_steps} per rank)"
