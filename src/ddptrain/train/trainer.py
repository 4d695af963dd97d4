"""The training loop: the split step, one epoch, exact evaluation, and the epoch loop."""

import random
import signal
import time
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from ddptrain import faults
from ddptrain.config import Config
from ddptrain.data.loaders import Data
from ddptrain.data.sampler import PADDING
from ddptrain.dist.collectives import broadcast_buffers
from ddptrain.dist.env import DistEnv
from ddptrain.errors import Stopped
from ddptrain.model.parallelize import unwrap
from ddptrain.model.precision import Precision
from ddptrain.report.metrics import MetricsLog, Sums, summarize
from ddptrain.state.checkpointer import Checkpointer, TrainState
from ddptrain.train.preempt import StopRequests

DATA_WAIT_WARNING = 0.2  # share of epoch time spent waiting for the loader
AUX_WEIGHT = 0.4  # googlenet and inception_v3 auxiliary heads, as torchvision's references


class Step:
    """One optimizer step, read as forward / backward / optimizer step: accumulation, clipping and
    non-finite checks go between these stages without touching the others. Gradients are
    reduced over the ranks inside backward (DDP's buckets, FSDP's reduce-scatter). No stage
    synchronises the host with the device."""

    def __init__(
        self, model: nn.Module, optimizer, precision: Precision | None = None, criterion=None
    ):
        self.model, self.optimizer = model, optimizer
        self.precision = precision or Precision()
        self.criterion = criterion or nn.CrossEntropyLoss()

    def forward(self, images: torch.Tensor, target: torch.Tensor):
        """The (device) loss and logits."""
        with self.precision.autocast():
            output = self.model(images)
            if isinstance(output, tuple):  # (logits, *auxiliary logits) in train mode
                output, *aux = output
                aux_loss = sum(self.criterion(a, target) for a in aux)
                return self.criterion(output, target) + AUX_WEIGHT * aux_loss, output
            return self.criterion(output, target), output

    def backward(self, loss: torch.Tensor) -> None:
        self.precision.backward(loss)

    def optimizer_step(self) -> None:
        self.precision.step(self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)  # frees the gradients until the next backward

    def __call__(self, images: torch.Tensor, target: torch.Tensor):
        loss, output = self.forward(images, target)
        self.backward(loss)
        self.optimizer_step()
        return loss, output


@torch.no_grad()
def evaluate(
    model: nn.Module, loader, env: DistEnv, precision: Precision | None = None
) -> dict[str, float]:
    """Cross-entropy loss, acc1 and acc5 over the whole val set: each rank its own shard, sums
    all-reduced, so every image counts once at any world size.

    Runs the wrapped model, as training does (under fsdp there is no other): every rank's shard
    is padded to the same number of batches (data/sampler.py EvalShard), and padded rows are
    masked out of the sums. A collective: every rank must call it.
    """
    precision = precision or Precision()
    # Under fsdp nothing else makes the ranks' BatchNorm statistics agree (DDP broadcasts them
    # at each training forward): evaluate, as save, with rank 0's.
    broadcast_buffers(unwrap(model), env)
    model.eval()
    sums = Sums(env.device)
    for images, target in loader:
        images = precision.inputs(images, env.device)
        target = target.to(env.device, non_blocking=True)
        with precision.autocast():
            output = model(images)
        loss_sum = F.cross_entropy(output.float(), target, ignore_index=PADDING, reduction="sum")
        sums.add_masked(loss_sum, output, target, target != PADDING)
    return sums.summary(env)


@dataclass
class Run:
    """Everything an epoch needs, built by run.py."""

    config: Config
    env: DistEnv
    data: Data
    model: nn.Module  # wrapped by its strategy
    optimizer: torch.optim.Optimizer  # over the wrapped model's parameters
    scheduler: torch.optim.lr_scheduler.LRScheduler
    log: MetricsLog
    seed: int
    precision: Precision
    checkpointer: Checkpointer | None  # None: nothing is saved (benchmarks, tests)
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
    """A checkpoint of state. A collective: every rank calls it."""
    if run.checkpointer is not None:
        run.checkpointer.save(state, is_best)
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
    model, step_once = run.model, Step(run.model, run.optimizer, run.precision)
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
        loss, output = step_once(images, target)
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
        f"{run.config.out_dir}: continue with --resume auto",
    )


def fit(run: Run, state: TrainState) -> TrainState:
    config, env = run.config, run.env
    faults.set_rank(env.rank)
    out_dir = config.out_dir
    start, val = time.perf_counter(), None
    for epoch in range(state.epoch, config.epochs):
        lr = run.optimizer.param_groups[0]["lr"]
        train = train_epoch(run, epoch, state)
        run.scheduler.step()
        val = evaluate(run.model, run.data.val_loader, env, run.precision)
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
