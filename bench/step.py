"""The training step alone, on batches already in memory: the ceiling of bench.train's (a).

  classic: the classic example's step (bench.classic): fp32, contiguous, a 1000-way head,
           normalised float batches (its workers' output), loss.item() and top-1/top-5 each step;
  ddptrain: step.Step with ddptrain's Precision (--amp none: fp32 + channels_last, or bf16)
           and its head, from the uint8 batches its loader yields, normalised by
           Precision.inputs, the batch's loss and accuracy summed on the device (trainer.Sums).

Both get the same images and torch's default threads; no loader runs, so the ratio of the two
is what ddptrain's math alone gains over the classic step.

    python -m bench.step {classic,none,bf16} -b 32 --image-size 224 --steps 10

prints a JSON line: samples/s of the timed steps.
"""

import argparse
import json
import time

import torch
import torchvision.models as models
from torch import nn

from bench.bound import random_batches
from bench.classic import MEAN, STD, accuracy
from ddptrain.config import Config
from ddptrain.model.build import build_model
from ddptrain.model.precision import run_precision
from ddptrain.report.metrics import Sums
from ddptrain.train.optim import build_optimizer
from ddptrain.train.step import Step

WARMUP_STEPS = 2


def classic_steps(batches, lr: float):
    """The classic step, one callable per batch (the float batches made up front)."""
    mean, std = torch.tensor(MEAN).view(1, 3, 1, 1), torch.tensor(STD).view(1, 3, 1, 1)
    floats = [((images.float() / 255 - mean) / std, target) for images, target in batches]
    model = models.resnet18()
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr, momentum=0.9, weight_decay=1e-4)
    model.train()

    def step(i: int) -> None:
        images, target = floats[i]
        output = model(images)
        loss = criterion(output, target)
        acc1, acc5 = accuracy(output, target, topk=(1, 5))
        loss.item(), acc1[0], acc5[0]
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    return step


def ddptrain_steps(batches, amp: str, lr: float, batch: int, image_size: int, classes: int):
    config = Config(
        dummy=True, batch_size=batch, workers=0, image_size=image_size, amp=amp,
        device="cpu", lr=lr, print_freq=10**9,
    )  # fmt: skip
    device = torch.device("cpu")
    model = build_model("resnet18", classes, image_size, pretrained=False)
    precision = run_precision(config, model, device)
    model = precision.place(model, device)
    optimizer, scheduler = build_optimizer(model, config.optim)
    step_once = Step(model, optimizer, precision, scheduler=scheduler)
    sums = Sums(device)
    model.train()

    def step(i: int) -> None:
        images, target = batches[i]
        loss, output = step_once(precision.inputs(images, device), target)
        sums.add(loss, output, target)

    return step


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("variant", choices=("classic", "none", "bf16"))
    parser.add_argument("-b", "--batch-size", type=int, default=32)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--classes", type=int, default=4)
    parser.add_argument("--lr", type=float, default=0.0125)
    args = parser.parse_args()
    count = WARMUP_STEPS + args.steps
    batches = random_batches(count, args.batch_size, args.image_size, args.classes, seed=0)
    if args.variant == "classic":
        step = classic_steps(batches, args.lr)
    else:
        step = ddptrain_steps(
            batches, args.variant, args.lr, args.batch_size, args.image_size, args.classes
        )
    for i in range(WARMUP_STEPS):
        step(i)
    start = time.perf_counter()
    for i in range(WARMUP_STEPS, count):
        step(i)
    rate = args.steps * args.batch_size / (time.perf_counter() - start)
    print(json.dumps({"samples_per_sec": rate, "threads": torch.get_num_threads()}))


if __name__ == "__main__":
    main()
