"""Measures what one DDP rank really holds in its first training steps, on real CPU tensors.

    python tests/e2e/real_step.py '{"arch": "resnet18", "per_rank_batch": 4, "image_size": 32,
                                    "num_classes": 10}'

and optionally "opt", "model_ema", "accum_steps", "freeze_backbone" (for the whole run) and
"grad_checkpointing" as the train flags of those names, set as run.py sets them.

prints one JSON object of bytes. The rank is a real DDP (gloo, gradient_as_bucket_view=True, as
ddptrain wraps with two or more ranks, its buckets laid out by ddptrain's backward of a blank
batch) in a group of one: a rank's memory under DDP does not depend on the number of ranks. The
model, precision (channels_last), optimizer, step and EMA are ddptrain's own.
Measured with MemTracker in real mode (what the tensors hold, by category), as the planner
measures its fake step. (bench/fsdp.py also counts the CPU allocator's own allocations with the
profiler, which takes a minute here: too slow for a test.)
"""

import json
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ddptrain.config import Config
from ddptrain.distributed.env import DistEnv
from ddptrain.model.build import build_model
from ddptrain.model.precision import run_precision
from ddptrain.model.providers import provider
from ddptrain.parallel.parallelize import lay_out_buckets
from ddptrain.tools.trace import Tracker as MemTracker  # torch's, frozen parameters allowed
from ddptrain.train.ema import build_ema
from ddptrain.train.finetune import fine_tuning
from ddptrain.train.optim import build_optimizer
from ddptrain.train.step import Step


def named(snapshot: dict) -> dict[str, int]:
    return {getattr(k, "value", k): v for per in snapshot.values() for k, v in per.items()}


def measure(
    arch: str,
    per_rank_batch: int,
    image_size: int,
    num_classes: int,
    opt: str = "sgd",
    model_ema: bool = False,
    accum_steps: int = 1,
    freeze_backbone: bool = False,
    grad_checkpointing: bool = False,
) -> dict:
    torch.manual_seed(0)
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    device = torch.device("cpu")
    config = Config(
        arch=arch, image_size=image_size, device="cpu", amp="none",  # as planned
        opt=opt, model_ema=model_ema, model_ema_steps=1, accum_steps=accum_steps,
        freeze_backbone=freeze_backbone, grad_checkpointing=grad_checkpointing,
    )  # fmt: skip
    model = build_model(arch, num_classes, image_size, pretrained=False)
    if grad_checkpointing:
        provider(arch).set_grad_checkpointing(model, arch)
    _, freezing = fine_tuning(config.optim, provider(arch), model, epoch=0)
    precision = run_precision(config, model, device)
    model = DistributedDataParallel(precision.place(model, device), gradient_as_bucket_view=True)
    if freezing is not None:
        freezing.train(model)
    blank = torch.zeros(2, 3, image_size, image_size, dtype=torch.uint8)
    lay_out_buckets(model, precision.inputs(blank, device), None)
    optimizer, _ = build_optimizer(model, config.optim, frozen_too=freezing is not None)
    ema = build_ema(model.module, config.optim, DistEnv(0, 1, 0, 1, device), steps_per_epoch=1)
    averaged = [] if ema is None else [ema.module]
    shape = (per_rank_batch, 3, image_size, image_size)
    images = precision.inputs(torch.randint(0, 256, shape, dtype=torch.uint8), device)
    target = torch.randint(0, num_classes, (per_rank_batch,))
    criterion = torch.nn.CrossEntropyLoss()
    trackers = []

    def next_forward(phase: str) -> None:  # a tracker follows one forward of a module at a time
        if phase == "forward":
            trackers[-1].reset_mod_stats()

    steps = 0

    def step() -> None:
        nonlocal steps
        Step(model, optimizer, precision, criterion, accum_steps=accum_steps, mark=next_forward)(
            images, target
        )
        steps += 1
        if ema is not None:
            ema.update(model.module, steps)

    first = MemTracker()  # step 1: the optimizer makes its state
    trackers.append(first)
    first.track_external(model, optimizer, images, target, *averaged)
    with first:
        step()
    tracker = MemTracker()
    trackers.append(tracker)
    tracker.track_external(model, optimizer, images, target, *averaged)
    after_forward = {}

    def at_end_of_forward(*_) -> None:  # activations saved for backward, all of them
        after_forward.setdefault("snap", named(tracker.get_tracker_snapshot()))

    model.module.register_forward_hook(at_end_of_forward)
    with tracker:
        before = named(tracker.get_tracker_snapshot())
        step()
        step()
    dist.destroy_process_group()
    first_peak, steady_peak = (named(t.get_tracker_snapshot("peak"))["Total"] for t in trackers)
    return {
        "params": before["Parameter"],
        "grads": before["Gradient"],
        "optimizer": before["Optstate"],
        "buffers": before["Buffer"],
        "activations": after_forward["snap"]["Activation"],
        "first_step_peak": first_peak,
        "peak": steady_peak,  # steps 2 and 3
    }


if __name__ == "__main__":
    print(json.dumps(measure(**json.loads(sys.argv[1]))))
