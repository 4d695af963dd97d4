"""The training loop: one step, one epoch, exact evaluation, and the epoch loop around them."""

import json
import os
import time
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from ddptrain import checkpoint
from ddptrain.checkpoint import TrainState
from ddptrain.config import Config
from ddptrain.data import Data, epoch_seed
from ddptrain.distributed import DistEnv, broadcast_buffers
from ddptrain.metrics import MetricsLog, Sums
from ddptrain.parallelize import unwrap
from ddptrain.precision import Precision

DATA_WAIT_WARNING = 0.2  # share of epoch time spent waiting for the loader
AUX_WEIGHT = 0.4  # googlenet and inception_v3 auxiliary heads, as torchvision's references


def train_step(
    model, criterion, optimizer, images, target, precision: Precision | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step. Returns the (device) loss and logits: no host synchronisation."""
    precision = precision or Precision()
    with precision.autocast():
        output = model(images)
        if isinstance(output, tuple):  # (logits, *auxiliary logits) in train mode
            output, *aux = output
            loss = criterion(output, target) + AUX_WEIGHT * sum(criterion(a, target) for a in aux)
        else:
            loss = criterion(output, target)
    optimizer.zero_grad(set_to_none=True)
    precision.backward_step(loss, optimizer)
    return loss, output


@torch.no_grad()
def evaluate(
    model: nn.Module, loader, env: DistEnv, criterion, precision: Precision | None = None
) -> dict[str, float]:
    """Loss, acc1 and acc5 over the whole val set: each rank its own disjoint shard, sums
    all-reduced, so every image counts once at any world size.

    Runs the unwrapped model: DDP's forward would sync buffers at every batch, which ranks with
    fewer batches would never match. A collective: every rank must call it.
    """
    precision = precision or Precision()
    model = unwrap(model)
    broadcast_buffers(model, env)
    model.eval()
    sums = Sums(env.device)
    for images, target in loader:
        images = precision.inputs(images, env.device)
        target = target.to(env.device, non_blocking=True)
        with precision.autocast():
            output = model(images)
            sums.add(criterion(output, target), output, target)
    return sums.summary(env)


@dataclass
class Run:
    """Everything an epoch needs, built by run.py."""

    config: Config
    env: DistEnv
    data: Data
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    meta: dict  # arch, num_classes, class_to_idx, config: saved with every checkpoint
    log: MetricsLog
    seed: int
    precision: Precision
    resolved_config: dict  # config.json: the configuration plus what the run resolved


def _maybe_stall(rank: int) -> None:
    """Fault injection for the tests only: DDPTRAIN_TEST_STALL_RANK=N hangs rank N forever
    before its first step, as a wedged process would."""
    if os.environ.get("DDPTRAIN_TEST_STALL_RANK") == str(rank):
        while True:
            time.sleep(3600)


def _log(env: DistEnv, line: str) -> None:
    if env.is_main:
        print(line, flush=True)


def _reseed(seed: int, epoch: int, rank: int) -> None:
    """Model-side randomness (dropout) from seed, epoch and rank alone, so a run resumed at an
    epoch boundary continues exactly as an uninterrupted one."""
    s = epoch_seed(seed + rank, epoch)
    torch.manual_seed(s)
    np.random.seed(s % 2**32)


def train_epoch(run: Run, epoch: int, state: TrainState) -> dict[str, float]:
    config, env = run.config, run.env
    model, criterion = run.model, nn.CrossEntropyLoss()
    model.train()
    run.data.train_sampler.set_epoch(epoch)
    steps = run.data.train_sampler.steps
    sums = Sums(env.device)
    start = time.perf_counter()
    waiting = 0.0
    batches = iter(run.data.train_loader)
    _maybe_stall(env.rank)
    for step in range(1, steps + 1):
        ready = time.perf_counter()
        images, target = next(batches)
        waiting += time.perf_counter() - ready
        images = run.precision.inputs(images, env.device)
        target = target.to(env.device, non_blocking=True)
        loss, output = train_step(model, criterion, run.optimizer, images, target, run.precision)
        sums.add(loss, output, target)
        state.global_step += 1
        if step % config.print_freq == 0 or step == steps:
            now = time.perf_counter()
            local = sums.summary()  # this rank's running means: a host sync, at print steps only
            rate = local["samples"] * env.world_size / (now - start)
            _log(
                env,
                f"epoch {epoch + 1}/{config.epochs} [{step:>{len(str(steps))}}/{steps}] "
                f"loss {local['loss']:.4f} acc1 {local['acc1']:6.2f} acc5 {local['acc5']:6.2f} "
                f"| {rate:7.1f} samples/s | data {100 * waiting / (now - start):4.1f}%",
            )
    elapsed = time.perf_counter() - start
    result = sums.summary(env)
    return {
        **result,
        "samples_per_sec": result["samples"] / elapsed,
        "data_wait": waiting / elapsed,
    }


def fit(run: Run, state: TrainState) -> TrainState:
    config, env = run.config, run.env
    criterion = nn.CrossEntropyLoss()
    out_dir = run.log.path.parent
    start, val = time.perf_counter(), None
    for epoch in range(state.epoch, config.epochs):
        lr = run.optimizer.param_groups[0]["lr"]
        _reseed(run.seed, epoch, env.rank)
        train = train_epoch(run, epoch, state)
        run.scheduler.step()
        val = evaluate(run.model, run.data.val_loader, env, criterion, run.precision)
        state.epoch = epoch + 1
        is_best = val["acc1"] > state.best_acc1
        state.best_acc1 = max(state.best_acc1, val["acc1"])
        if env.is_main:
            ckpt = checkpoint.payload(
                unwrap(run.model), run.optimizer, run.scheduler, state, run.meta
            )
            if run.precision.scaler is not None:
                ckpt["scaler"] = run.precision.scaler.state_dict()
            checkpoint.save(out_dir, ckpt, is_best)
            # Written with the checkpoint, not before: a run that fails early changes nothing.
            config_json = json.dumps(run.resolved_config, indent=2).encode()
            checkpoint.atomic_write(out_dir / "config.json", config_json)
        run.log.write({"split": "train", "epoch": state.epoch, "lr": lr, **train})
        run.log.write({"split": "val", "epoch": state.epoch, **val})
        if train["data_wait"] > DATA_WAIT_WARNING:
            _log(
                env,
                f"warning: {100 * train['data_wait']:.0f}% of the epoch went to waiting for data; "
                f"try more loader workers (-j, now {config.workers}), a smaller --image-size, "
                "or smaller images on faster storage",
            )
        _log(
            env,
            f"epoch {state.epoch}/{config.epochs} done: train loss {train['loss']:.4f} "
            f"acc1 {train['acc1']:.2f} ({train['samples_per_sec']:.1f} samples/s) | val loss "
            f"{val['loss']:.4f} acc1 {val['acc1']:.2f} acc5 {val['acc5']:.2f} "
            f"({val['samples']} images) | best acc1 {state.best_acc1:.2f}",
        )
    if val is None:
        _log(env, f"nothing to train: {state.epoch} of {config.epochs} epochs already done")
    else:
        _log(
            env,
            f"trained in {time.perf_counter() - start:.0f} s: val acc1 {val['acc1']:.2f} "
            f"(best {state.best_acc1:.2f}); checkpoints in {out_dir}",
        )
    return state
