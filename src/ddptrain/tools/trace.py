"""One training step traced on fake tensors: what a rank holds under ddp and under fsdp, measured
without allocating it, so models that do not fit this machine can be planned.

    python -m ddptrain.tools.trace '{"arch": ..., "strategies": ["ddp", "fsdp"], ...}' REPLY.json

writes one JSON object (bytes per rank, per strategy) to REPLY.json. It runs in a process of its
own, started by `ddptrain.tools.plan`: the fake process group it initialises and its fake tensors
must never meet a real run's process group or tensors.

How each strategy is traced, as the trainer runs it (`train.step.Step`: forward, backward,
optimizer step, zero_grad, under --accum-steps over as many micro-batches, which fsdp does not
reduce-scatter before the last, holding whole gradients; the request's optimizer from
`train.optim`):
- ddp: the plain model under `MemTracker`. With two or more ranks the trainer wraps it in DDP with
  gradient_as_bucket_view=True: DDP allocates buckets as large as all gradients when it is built,
  and after each backward a gradient is copied into its bucket and becomes a view of it, so the
  gradients live for the whole run. DDP's C++ reducer cannot run on fake tensors, so a hook does the
  same here: one bucket per parameter, allocated up front, the gradient copied in. Once, before
  training (`parallel.parallelize.lay_out_buckets`, before the optimizer holds any state), DDP
  rebuilds its buckets in the order gradients arrived, holding old and new buckets at once:
  `bucket_rebuild`, counted in the peak. One rank: the trainer does not wrap, gradients are
  freed by zero_grad and made again in backward.
- fsdp: `parallel.fsdp.shard` over a fake process group of world_size ranks (this process is
  rank 0; FSDP2 pads every shard to the same size, so all ranks hold the same), under
  `FSDPMemTracker`, which also sees the all-gather and reduce-scatter buffers.
--grad-checkpointing and --freeze-backbone are set on the model as run.py sets them, before
fsdp shards it: a checkpointed block keeps its input for backward and recomputes the rest there;
a frozen backbone gets no gradients, buckets or optimizer state, and its BatchNorm layers run in
eval mode (frozen for the whole run: `plan` plans a run that unfreezes it as unfrozen).
The traced step is the second one: the optimizer's state exists and gradients of the previous
step are still held during forward (zero_grad comes after it), as in every step after the first.
--model-ema's average is not traced but added: it is one more copy of what the rank holds (its
parameters, under fsdp its shards, and its buffers), made before the first step and updated in
place, so it adds its size to every moment of the step. It is made after DDP lays out its
buckets (`run.py`), so the bucket rebuild does not hold it.
"""

import itertools
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
    UnsupportedOperatorException,
)
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed._tools.mem_tracker import MemTracker
from torch.testing._internal.distributed.fake_pg import FakeStore

from ddptrain.config import OptimSettings
from ddptrain.errors import UserError, end_process, first_line
from ddptrain.model.build import CropError, build_model
from ddptrain.model.precision import DTYPES, Precision
from ddptrain.model.providers import provider
from ddptrain.parallel.fsdp import shard
from ddptrain.train.finetune import Freezing, fine_tuning
from ddptrain.train.optim import build_optimizer
from ddptrain.train.step import Step, gradients_set_to_none

STRATEGIES = ("ddp", "fsdp")
# What a step of a model cannot do on fake tensors: read values (`.item()`, data-dependent shapes).
UNTRACEABLE = (
    DataDependentOutputException,
    DynamicOutputShapeException,
    UnsupportedOperatorException,
)


class ModelError(Exception):
    """The model does not run at these settings: the user's to fix (reported in one line)."""


def _meta_model(arch: str, num_classes: int, image_size: int) -> nn.Module:
    """The model on the meta device: shapes, no data. A builder that computes with tensors (RegNet
    derives its widths so) cannot run there: it builds on the CPU, checked with one forward as a
    run's rank 0 builds it, and its weights are allocated for as long as it takes to move them to
    meta."""
    try:
        model = build_model(arch, num_classes, image_size, pretrained=False, meta=True)
    except CropError as err:  # a ViT whose patches do not divide the crops
        raise ModelError(f"it does not run on {image_size} px crops: {err.reason}") from None
    return model.to("meta")


def _trained_as_run(model: nn.Module, request: dict) -> Freezing | None:
    """The model checkpointed (--grad-checkpointing) and its backbone frozen (--freeze-backbone,
    for the whole run) as run.py sets them, before fsdp shards it; the freezing, if any."""
    arch = request["arch"]
    source = provider(arch)
    if request["grad_checkpointing"]:
        try:
            source.set_grad_checkpointing(model, arch)
        except UserError as err:  # a model without blocks: refused, as the run refuses it
            raise ModelError(str(err)) from None
    optim = OptimSettings(freeze_backbone=request["freeze_backbone"])
    return fine_tuning(optim, source, model, epoch=0)[1]


def _fake_model(
    request: dict, strategy: str, fake_mode: FakeTensorMode
) -> tuple[nn.Module, Freezing | None]:
    """The model with fake parameters, sharded for fsdp, in training mode as the run trains it;
    and its freezing (--freeze-backbone), if any.

    Built on the meta device, so nothing is allocated or initialised; fsdp shards it there (its
    device mesh is made of real tensors, which fake mode would refuse); `to_empty` then gives it
    fake parameters. Contiguous layout, as fsdp keeps its shards (the layout
    changes no tensor's size).
    """
    arch = request["arch"]
    model = _meta_model(arch, request["num_classes"], request["image_size"])
    freezing = _trained_as_run(model, request)
    if strategy == "fsdp":
        shard(
            model,
            arch,
            DTYPES[request["amp"]],
            reshard_after_forward=request["reshard_after_forward"],
        )
    fake_mode.allow_non_fake_inputs = True  # the meta parameters `to_empty` replaces
    try:
        with fake_mode:
            model.to_empty(device="cpu")
    finally:
        fake_mode.allow_non_fake_inputs = False
    if freezing is None:
        model.train()
    else:  # the frozen backbone's BatchNorm layers in eval mode, saving nothing for backward
        freezing.train(model)
    return model, freezing


def _keep_gradients_in_buckets(model: nn.Module, accum_steps: int) -> list[torch.Tensor]:
    """DDP's gradient_as_bucket_view, as a hook: each gradient copied into a bucket allocated up
    front, then made a view of it. Under --accum-steps, the backward passes before a step's last
    run in DDP's no_sync, which leaves each gradient where autograd accumulates it: in the
    bucket, where `Step` zeroes it (and where `lay_out_buckets` leaves it before the first
    step). Returns the buckets (they must stay referenced)."""
    buckets = []
    for param in (p for p in model.parameters() if p.requires_grad):  # DDP's: those that train
        bucket = torch.empty_like(param)
        buckets.append(bucket)
        backwards = itertools.count(1)

        def into_bucket(p: torch.Tensor, bucket=bucket, backwards=backwards) -> None:
            if next(backwards) % accum_steps:  # not the step's last backward: no_sync
                return
            bucket.copy_(p.grad)
            p.grad = bucket

        param.register_post_accumulate_grad_hook(into_bucket)
    return buckets


class _NoHook:
    def remove(self) -> None:
        pass


class FrozenSkipped:
    """A tracker that puts no gradient hook on frozen parameters (--freeze-backbone): torch's
    hooks each parameter of every module whose forward it sees, and a tensor that requires no
    gradient refuses a hook. Marked as hooked, they are counted still, as parameters."""

    def _track_module_params_and_buffers(self, module: nn.Module, install_grad_hooks=True):
        hooked = self._param_to_grad_hook_handles
        for param in module.parameters():
            if not param.requires_grad and param not in hooked:
                hooked[param] = (_NoHook(), _NoHook())  # marked as hooked already
        return super()._track_module_params_and_buffers(module, install_grad_hooks)


class Tracker(FrozenSkipped, MemTracker):
    """MemTracker, frozen parameters allowed."""


class FSDPTracker(FrozenSkipped, FSDPMemTracker):
    """FSDPMemTracker, frozen parameters allowed."""


def _named(snapshot: dict) -> dict[str, int]:
    """A tracker snapshot ({device: {category: bytes}}) as {category name: bytes}, devices
    summed (the categories are enums whose hash is not their name's)."""
    named: dict[str, int] = {}
    for per_device in snapshot.values():
        for category, size in per_device.items():
            name = getattr(category, "value", category)
            named[name] = named.get(name, 0) + size
    return named


def _all_snapshots(tracker: MemTracker) -> list[dict[str, int]]:
    """Every snapshot the tracker took at module boundaries, and its peak."""
    snaps = [
        _named(snap)
        for stats in tracker.memory_tracking.values()
        for per_state in stats.snapshots.values()
        for snap in per_state
    ]
    return [*snaps, _named(tracker.get_tracker_snapshot("peak"))]


def _after_forward(model: nn.Module, tracker: MemTracker) -> dict[str, dict[str, int]]:
    """Fills in the tracker's snapshot at the end of the model's forward (all activations saved
    for backward): a hook of our own, as the root of an fsdp model holding no parameters of its
    own gets no snapshots from FSDPMemTracker."""
    taken: dict[str, dict[str, int]] = {}

    def snapshot(module, inputs, outputs) -> None:
        taken["snapshot"] = _named(tracker.get_tracker_snapshot("current"))

    model.register_forward_hook(snapshot)
    return taken


def trace(request: dict, strategy: str) -> dict[str, int | None]:
    """Per-rank bytes of one steady-state training step of request's model under strategy."""
    fake_mode = FakeTensorMode()
    model, freezing = _fake_model(request, strategy, fake_mode)
    wraps_in_ddp = strategy == "ddp" and request["world_size"] > 1
    with fake_mode:
        config = OptimSettings(opt=request["opt"], momentum=request["momentum"])
        # As the run builds it: it keeps no state for a parameter that gets no gradient.
        optimizer, _ = build_optimizer(model, config, frozen_too=freezing is not None)
        batch, size = request["per_rank_batch"], request["image_size"]
        images = torch.randn(batch, 3, size, size)
        target = torch.randint(0, request["num_classes"], (batch,))
        accum_steps = request["accum_steps"]
        buckets = _keep_gradients_in_buckets(model, accum_steps) if wraps_in_ddp else []
        precision = Precision("cpu", request["amp"])
        # nn.CrossEntropyLoss's function: MemTracker refuses a module called more than once
        # outside the model, as the loss is for the auxiliary heads of googlenet and inception.
        criterion = nn.functional.cross_entropy
        step = Step(model, optimizer, precision, criterion, accum_steps=accum_steps)
        # The traced model is not wrapped: Step is told that DDP would hold its gradients.
        step.set_to_none = gradients_set_to_none(accum_steps, in_buckets=wraps_in_ddp)
        try:
            step(images, target)
        except UNTRACEABLE as err:
            raise ModelError(
                f"its step cannot be traced on fake tensors ({first_line(err)})"
            ) from None
        except (RuntimeError, AssertionError, ValueError) as err:
            raise ModelError(f"it does not run on {size} px crops: {first_line(err)}") from None
        if strategy == "fsdp":
            tracker = FSDPTracker(model, optimizer)
            tracker.track_inputs((images, target))
        else:
            tracker = Tracker()
            tracker.track_external(model, optimizer, images, target)
        after_forward = _after_forward(model, tracker)
        earlier: list[dict[str, int]] = []  # of the micro-batches before the last

        def before_each_forward(phase: str) -> None:
            # A tracker follows one forward of each module at a time: under --accum-steps,
            # keep what it saw of a micro-batch before the next one's forward.
            if phase == "forward":
                earlier.extend(_all_snapshots(tracker))
                tracker.reset_mod_stats()

        step.mark = before_each_forward
        with tracker:
            before = _named(tracker.get_tracker_snapshot("current"))
            step(images, target)
        del buckets
    snapshots = earlier + _all_snapshots(tracker)
    figures = _figures(strategy, before, after_forward["snapshot"], snapshots, wraps_in_ddp)
    return _with_ema(figures) if request["model_ema"] else figures


def _figures(strategy, before, after_forward, snapshots, wraps_in_ddp) -> dict[str, int | None]:
    at_step_peak = max(snapshots, key=lambda s: s.get("Total", 0))
    step_peak = at_step_peak.get("Total", 0)
    sharded = strategy == "fsdp"
    grads = before.get("Sharded Grad" if sharded else "Gradient", 0)
    figures = {
        "params": before.get("Sharded Param" if sharded else "Parameter", 0),
        "grads": grads,
        "optimizer": before.get("OptState" if sharded else "Optstate", 0),
        "ema": 0,
        "buffers": before.get("Buffer", 0),
        "inputs": before.get("Inputs" if sharded else "Other", 0),
        "activations": after_forward.get("Activation", 0),
        # DDP's buckets are the gradients (gradient_as_bucket_view): nothing beyond "grads".
        "comm_buffers": 0,
        "all_gather_peak": None,
        "bucket_rebuild": None,
        "step_peak": step_peak,
    }
    if sharded:
        figures["comm_buffers"] = max(
            s.get("All Gather", 0) + s.get("Reduce Scatter", 0) for s in snapshots
        )
        figures["all_gather_peak"] = max(
            s.get("All Gather", 0) + s.get("Unsharded Param", 0) for s in snapshots
        )
    if wraps_in_ddp:  # what a step starts with, less the optimizer's state, plus new buckets
        figures["bucket_rebuild"] = before.get("Total", 0) - figures["optimizer"] + grads
    figures["peak"] = max(step_peak, figures["bucket_rebuild"] or 0)
    figures["at_step_peak"] = {
        name: size for name, size in at_step_peak.items() if size and name != "Total"
    }
    return figures


def _with_ema(figures: dict) -> dict:
    """The figures with --model-ema's average held through the step (see the module's doc)."""
    ema = figures["params"] + figures["buffers"]
    step_peak = figures["step_peak"] + ema
    at_step_peak = {**figures["at_step_peak"], "EMA": ema}
    peak = max(step_peak, figures["bucket_rebuild"] or 0)
    return {
        **figures,
        "ema": ema,
        "step_peak": step_peak,
        "peak": peak,
        "at_step_peak": at_step_peak,
    }


def main(argv: list[str]) -> int:
    request, reply = json.loads(argv[0]), Path(argv[1])
    dist.init_process_group("fake", rank=0, world_size=request["world_size"], store=FakeStore())
    try:
        result = {s: trace(request, s) for s in request["strategies"]}
    except ModelError as err:
        result, code = {"error": str(err)}, 2
    else:
        code = 0
    finally:
        dist.destroy_process_group()
    reply.write_text(json.dumps(result))
    return code


if __name__ == "__main__":
    end_process(main(sys.argv[1:]))
