"""The training loop: one step, one epoch, exact evaluation, and the epoch loop around them."""

import json
import random
import signal
import time
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from ddptrain import faults
from ddptrain.config import Config
from ddptrain.data.loaders import Data
from ddptrain.dist.collectives import broadcast_buffers
from ddptrain.dist.env import DistEnv
from ddptrain.errors import Stopped
from ddptrain.model.parallelize import unwrap
from ddptrain.model.precision import Precision
from ddptrain.report.metrics import MetricsLog, Sums, summarize
from ddptrain.state import files
from ddptrain.state.files import TrainState
from ddptrain.train.preempt import StopRequests

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
    meta: dict  # arch, num_classes, class_to_idx, config, data_seed: saved with every checkpoint
    log: MetricsLog
    seed: int
    precision: Precision
    resolved_config: dict  # config.json: the configuration plus what the run resolved
    stop: StopRequests


def _log(env: DistEnv, line: str) -> None:
    if env.is_main:
        print(line, flush=True)


def _reseed(seed: int, epoch: int, step: int, rank: int) -> None:
    """Model-side randomness (dropout, stochastic depth) from seed, epoch, step and rank alone,
    as augmentation is from each sample's seed: a run resumed at any step draws what an
    uninterrupted one would, with no generator state to save."""
    state = np.random.SeedSequence([seed, epoch, step, rank]).generate_state(2, np.uint64)
    torch.manual_seed(int(state[0] >> 1))
    np.random.seed(int(state[1] % 2**32))
    random.seed(int(state[1]))


def save(run: Run, state: TrainState, is_best: bool = False) -> None:
    """Writes a checkpoint of state (rank 0 writes; a collective when state carries the epoch's
    train sums, which every rank contributed to)."""
    env = run.env
    if env.is_main:
        model = unwrap(run.model)
        scaler = run.precision.scaler
        ckpt = files.payload(model, run.optimizer, run.scheduler, state, run.meta, scaler)
        out_dir = run.log.path.parent
        files.save(out_dir, ckpt, is_best, run.config.keep_last)
        # Written with the checkpoint, not before: a run that fails early changes nothing.
        config_json = json.dumps(run.resolved_config, indent=2).encode()
        files.atomic_write(out_dir / "config.json", config_json)
    run.stop.unsaved = False


def _backward_fault(model: nn.Module, step: int) -> None:
    """Test fault injection inside the backward pass: the first layer's gradient comes last, once
    DDP has already all-reduced the other buckets."""
    if faults.armed("backward", step):
        first = next(model.parameters())
        first.register_hook(lambda grad: faults.kill_point("backward", step))


def train_epoch(run: Run, epoch: int, state: TrainState) -> dict[str, float]:
    """Trains epoch `epoch` from step state.epoch_step; returns its train record. Stops every
    rank, after a checkpoint, when a stop signal is agreed on."""
    config, env = run.config, run.env
    model, criterion = run.model, nn.CrossEntropyLoss()
    model.train()
    sampler = run.data.train_sampler
    first = state.epoch_step
    sampler.set_epoch(epoch, first)
    steps = sampler.steps
    sums = Sums(env.device)  # this run's part of the epoch; state.train_sums holds the rest
    carried = (
        state.train_sums if state.train_sums is not None else torch.zeros(4, dtype=torch.float64)
    )
    start = time.perf_counter()
    waiting = 0.0
    batches = iter(run.data.train_loader)
    faults.maybe_stall(env.rank)
    for step in range(first + 1, steps + 1):
        faults.kill_point("between", state.global_step + 1)
        signum = run.stop.agreed()
        if signum:
            _stop(run, state, sums, carried, signum)
        _reseed(run.seed, epoch, step, env.rank)
        ready = time.perf_counter()
        images, target = next(batches)
        waiting += time.perf_counter() - ready
        images = run.precision.inputs(images, env.device)
        target = target.to(env.device, non_blocking=True)
        _backward_fault(model, state.global_step + 1)
        loss, output = train_step(model, criterion, run.optimizer, images, target, run.precision)
        sums.add(loss, output, target)
        state.global_step += 1
        state.epoch_step = step
        run.stop.unsaved = True
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
        every = config.checkpoint_every
        # Not at the epoch's last step: the epoch's end has its own checkpoint, after evaluation.
        if every and state.global_step % every == 0 and step < steps:
            state.train_sums = sums.totals(env) + carried
            save(run, state)
    elapsed = time.perf_counter() - start
    new = sums.totals(env)
    return {
        **summarize(new + carried),
        "samples_per_sec": new[3].item() / elapsed,
        "data_wait": waiting / elapsed,
    }


def _stop(run: Run, state: TrainState, sums: Sums, carried: torch.Tensor, signum: int) -> None:
    """Every rank agreed to stop: checkpoint where we are (unless just saved), then exit."""
    if run.stop.unsaved:
        state.train_sums = sums.totals(run.env) + carried
        save(run, state)
    raise Stopped(
        signum,
        f"stopped by {signal.Signals(signum).name} after global step {state.global_step} "
        f"({state.epoch_step} steps of epoch {state.epoch + 1} done); checkpoint in "
        f"{run.log.path.parent}: continue with --resume auto",
    )


def fit(run: Run, state: TrainState) -> TrainState:
    config, env = run.config, run.env
    faults.set_rank(env.rank)
    criterion = nn.CrossEntropyLoss()
    out_dir = run.log.path.parent
    start, val = time.perf_counter(), None
    for epoch in range(state.epoch, config.epochs):
        lr = run.optimizer.param_groups[0]["lr"]
        train = train_epoch(run, epoch, state)
        run.scheduler.step()
        val = evaluate(run.model, run.data.val_loader, env, criterion, run.precision)
        state.epoch, state.epoch_step, state.train_sums = epoch + 1, 0, None
        is_best = val["acc1"] > state.best_acc1
        state.best_acc1 = max(state.best_acc1, val["acc1"])
        # Logged before the checkpoint: a run killed in between resumes from the previous
        # checkpoint, which drops these records (MetricsLog.keep_until) and logs them again.
        run.log.write({"split": "train", "epoch": state.epoch, "lr": lr, **train})
        run.log.write({"split": "val", "epoch": state.epoch, **val})
        save(run, state, is_best)
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
