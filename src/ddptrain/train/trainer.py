"""The training loop: one epoch of steps (train/step.py), exact evaluation, and the epoch loop."""

import random
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from ddptrain.config import Config
from ddptrain.data.loaders import Data
from ddptrain.data.sampler import PADDING
from ddptrain.distributed.collectives import broadcast_buffers
from ddptrain.distributed.env import DistEnv
from ddptrain.distributed.phases import Phases
from ddptrain.errors import Stopped, UserError
from ddptrain.faults import Faults
from ddptrain.model.precision import Precision
from ddptrain.parallel.parallelize import reshard_gathered, unwrap
from ddptrain.report.metrics import EvalSums, Sums, summarize
from ddptrain.report.per_class import per_class_record
from ddptrain.report.profile import StepProfiler
from ddptrain.report.progress import shown
from ddptrain.report.reporter import Reporter
from ddptrain.state.checkpointer import Checkpointer, TrainState
from ddptrain.state.files import numbered
from ddptrain.train.ema import ModelEma
from ddptrain.train.finetune import Freezing
from ddptrain.train.loss import Criterion
from ddptrain.train.optim import group_lrs, schedule_lr
from ddptrain.train.preempt import StopRequests
from ddptrain.train.step import Step

DATA_WAIT_WARNING = 0.2  # share of epoch time spent waiting for the loader


@torch.no_grad()
def evaluate(
    model: nn.Module,
    loader,
    env: DistEnv,
    precision: Precision | None = None,
    count: Callable[[int], None] | None = None,
) -> dict:
    """Cross-entropy loss, acc1 and acc5 over the whole val set, and under "confusion" the
    C x C counts of true class (row) against top-1 class (column): each rank its own shard, sums
    all-reduced, so every image counts once at any world size.

    Runs the wrapped model, as training does (under fsdp there is no other): every rank's shard
    is padded to the same number of batches (data/sampler.py EvalShard), and padded rows are
    masked out of the sums. A collective: every rank must call it. `count(n)` hears of batch n
    (Phases.count: a stall's error names the batch a rank stopped at).
    """
    precision = precision or Precision()
    # Under fsdp nothing else makes the ranks' BatchNorm statistics agree (DDP broadcasts them
    # at each training forward): evaluate, as save, with rank 0's.
    broadcast_buffers(unwrap(model), env)
    model.eval()
    sums = EvalSums(env.device)
    for batch, (images, target) in enumerate(loader, 1):
        if count is not None:
            count(batch)
        images = precision.inputs(images, env.device)
        target = target.to(env.device, non_blocking=True)
        with precision.autocast():
            output = model(images)
        loss_sum = F.cross_entropy(output.float(), target, ignore_index=PADDING, reduction="sum")
        sums.add_masked(loss_sum, output, target, target != PADDING)
    reshard_gathered(model)  # under fsdp: not held whole into training (the EMA's, for good)
    metrics, confusion = sums.result(env)
    return {**metrics, "confusion": confusion}


@dataclass
class Run:
    """Everything an epoch needs, built by run.py."""

    config: Config
    env: DistEnv
    data: Data
    model: nn.Module  # wrapped by its strategy
    optimizer: torch.optim.Optimizer  # over the wrapped model's parameters
    scheduler: torch.optim.lr_scheduler.LRScheduler  # stepped per optimizer step
    reporter: Reporter
    seed: int
    precision: Precision
    checkpointer: Checkpointer | None  # None: nothing is saved (benchmarks, tests)
    stop: StopRequests
    criterion: Criterion | None = None  # None: plain cross-entropy
    ema: ModelEma | None = None
    skipped: int = 0  # steps whose update --nonfinite skip dropped in this run
    phases: Phases | None = None  # None: no record of where this rank is
    profiler: StepProfiler | None = None  # --profile, on rank 0
    faults: Faults | None = None  # the test suite's, when it asks for some (faults.py)
    state: TrainState | None = None  # where it starts
    summary: dict | None = None  # what summary.csv records of it
    freezing: Freezing | None = None  # --freeze-backbone
    # The model wrapped anew once parameters start to train (--unfreeze-epoch): DDP knows only
    # those that required gradients when it was built.
    rewrap: Callable[[nn.Module], nn.Module] | None = None

    def step(self) -> Step:
        return Step(
            self.model,
            self.optimizer,
            self.precision,
            self.criterion,
            self.scheduler,
            self.config.optim.accum_steps,
            self.config.optim.clip_grad_norm,
            skip_nonfinite=self.config.optim.nonfinite == "skip",
            mark=None if self.phases is None else self.phases.within_step,
        )

    def enter_epoch(self, epoch: int) -> None:
        """The backbone frozen or not, as --freeze-backbone and --unfreeze-epoch say for
        `epoch`: a resumed run's state follows from the epoch alone."""
        if self.freezing is not None and self.freezing.enter(epoch) and self.rewrap is not None:
            self.model = self.rewrap(self.model)

    def train_mode(self) -> None:
        if self.freezing is None:
            self.model.train()
        else:
            self.freezing.train(self.model)

    def mark(self, phase: str, global_step: int) -> None:
        if self.phases is not None:
            self.phases.enter(phase, global_step)
        if self.faults is not None:
            self.faults.entered(phase, global_step)

    def evaluate(self, model: nn.Module, phase: str, global_step: int) -> tuple[dict, dict]:
        """evaluate() on the val set, recorded as `phase` of global_step: its metrics.jsonl
        figures and its per_class.jsonl figures. A collective."""
        self.mark(phase, global_step)

        def count(batch: int) -> None:
            if self.phases is not None:
                self.phases.count(batch)
            if self.faults is not None:
                self.faults.evaluating(global_step, batch)

        metrics = evaluate(model, self.data.val_loader, self.env, self.precision, count)
        classes = sorted(self.data.class_to_idx, key=self.data.class_to_idx.get)
        return metrics, per_class_record(metrics.pop("confusion"), classes)


def _reseed(seed: int, epoch: int, step: int, rank: int) -> None:
    """Model-side randomness (dropout, stochastic depth, mixup) from seed, epoch, step and rank
    alone, as augmentation is from each sample's seed: a run resumed at any step draws what an
    uninterrupted one would, with no generator state to save."""
    state = np.random.SeedSequence([seed, epoch, step, rank]).generate_state(2, np.uint64)
    torch.manual_seed(int(state[0] >> 1))
    np.random.seed(int(state[1] % 2**32))
    random.seed(int(state[1]))


def save(run: Run, state: TrainState, is_best: bool = False) -> None:
    """A checkpoint of state. A collective: every rank calls it."""
    run.mark("checkpoint: gathering", state.global_step)
    if run.checkpointer is not None:
        run.checkpointer.save(state, is_best)
    run.stop.unsaved = False


def train_epoch(run: Run, epoch: int, state: TrainState) -> dict[str, float]:
    """Trains epoch `epoch` from step state.epoch_step; returns its train record. Stops every
    rank, after a checkpoint, when a stop signal is agreed on.

    With mixup or cutmix, train accuracy counts a row as right when the model's top class is
    the mixed target's class of largest weight: the label that covers more of the image."""
    config, env, reporter = run.config, run.env, run.reporter
    model, step_once = run.model, run.step()
    run.train_mode()
    sampler = run.data.train_sampler
    first = state.epoch_step
    sampler.set_epoch(epoch, first)
    steps = sampler.steps
    sums = Sums(env.device)  # this run's part of the epoch; state.train_sums holds the rest
    carried = (
        state.train_sums if state.train_sums is not None else torch.zeros(4, dtype=torch.float64)
    )
    start = time.perf_counter()
    waiting, skipped = 0.0, 0
    # The first global step with a non-finite loss on this rank, kept on the device (0: none):
    # read at print steps only, so finding it costs no host synchronisation.
    first_bad = torch.zeros((), dtype=torch.int64, device=env.device)
    batches = iter(run.data.train_loader)
    reporter.begin_epoch(epoch, config.optim.epochs, first, steps)
    run.mark("data fetch", state.global_step + 1)
    run.stop.agreeing = True
    for step in range(first + 1, steps + 1):
        run.mark("step agreement", state.global_step + 1)
        signum = run.stop.agreed()
        if run.stop.nonfinite_step:
            _nonfinite(run, run.stop.nonfinite_step)
        if signum:
            _stop(run, state, sums, carried, signum)
        _reseed(run.seed, epoch, step, env.rank)
        ready = time.perf_counter()
        run.mark("data fetch", state.global_step + 1)
        images, target = next(batches)
        waiting += time.perf_counter() - ready
        images = run.precision.inputs(images, env.device)
        target = target.to(env.device, non_blocking=True)
        if run.criterion is not None:
            images, target = run.criterion.prepare(images, target, torch.default_generator)
        result = step_once(images, target)
        state.global_step += 1
        if result.skipped:
            skipped += 1
            _count_skipped(run, state)
        else:
            sums.add(result.loss, result.output, Criterion.hard_target(target))
            bad = (first_bad == 0) & ~torch.isfinite(result.loss.detach())
            first_bad = torch.where(bad, state.global_step, first_bad)
        state.epoch_step = step
        if run.ema is not None and not result.skipped:  # a dropped step moves nothing
            run.ema.update(unwrap(model), state.global_step)
        run.stop.unsaved = True
        reporter.advance()
        if run.profiler is not None:
            run.profiler.step()
        if step % config.report.print_freq == 0 or step == steps:
            now = time.perf_counter()
            local = sums.summary()  # this rank's running means: a host sync, at print steps only
            if first_bad:  # agreed at the next boundary, with the stop signals
                run.stop.report_nonfinite(int(first_bad))
            rate = local["samples"] * env.world_size / (now - start)
            lr = schedule_lr(run.optimizer)
            values = {**local, "samples_per_sec": rate, "data_wait": waiting / (now - start)}
            reporter.print_step(step, state.global_step, {**values, "lr": lr})
        if run.checkpointer is not None and run.checkpointer.due(state, steps):
            state.train_sums = _finite(run, state, sums.totals(env) + carried)
            save(run, state)
    reporter.end_epoch()
    elapsed = time.perf_counter() - start
    new = _finite(run, state, sums.totals(env))
    return {
        **summarize(new + carried),
        "samples_per_sec": new[3].item() / elapsed,
        "data_wait": waiting / elapsed,
        "skipped": skipped,
    }


def _finite(run: Run, state: TrainState, totals: torch.Tensor) -> torch.Tensor:
    """totals (all-reduced: the same on every rank), unless a loss in them was not finite."""
    if not torch.isfinite(totals).all():
        _nonfinite(run, state.global_step, at_or_before=True)
    return totals


def _nonfinite(run: Run, global_step: int, at_or_before: bool = False) -> None:
    """Every rank stops here: training went non-finite, and nothing after it is saved."""
    saved = numbered(Path(run.config.checkpoint.out_dir))
    then = (
        f"the last good checkpoint is {saved[0]}: resume from it with --resume auto and"
        if saved
        else "no checkpoint was written: start again with"
    )
    when = (
        f"at or before global step {global_step}"
        if at_or_before
        else f"at global step {global_step}"
    )
    raise UserError(
        f"the loss or its gradients became non-finite {when} (--nonfinite error); {then} a "
        "lower --lr, or train with --nonfinite skip"
    )


def _count_skipped(run: Run, state: TrainState) -> None:
    run.skipped += 1
    if run.skipped >= run.config.optim.max_skipped:
        raise UserError(
            f"--nonfinite skip: {run.skipped} steps had non-finite gradients, the last at global "
            f"step {state.global_step} (--max-skipped {run.config.optim.max_skipped}); lower "
            "--lr, or try --clip-grad-norm"
        )


def _stop(run: Run, state: TrainState, sums: Sums, carried: torch.Tensor, signum: int) -> None:
    """Every rank agreed to stop: checkpoint where we are (unless just saved), then exit."""
    if run.stop.unsaved:
        state.train_sums = sums.totals(run.env) + carried
        save(run, state)
    raise Stopped(
        signum,
        f"stopped by {signal.Signals(signum).name} after global step {state.global_step} "
        f"(step {state.epoch_step} of epoch {state.epoch + 1}); checkpoint in "
        f"{run.config.checkpoint.out_dir}: continue with --resume auto",
    )


def _validate(run: Run, global_step: int) -> tuple[dict, dict | None, list[dict]]:
    """The val record of the model and, with --model-ema, of its average, and the per-class
    figures of each (split and epoch still to be added). A collective."""
    val, classes = run.evaluate(run.model, "evaluation", global_step)
    if run.ema is None:
        return val, None, [{"split": "val", **classes}]
    val_ema, classes_ema = run.evaluate(run.ema.module, "EMA evaluation", global_step)
    return val, val_ema, [{"split": "val", **classes}, {"split": "val_ema", **classes_ema}]


def _early_stop_record(config: Config, state: TrainState, at: dict) -> dict:
    """metrics.jsonl's record that training stopped early, and why."""
    return {
        "split": "early_stop",
        **at,
        "patience": config.optim.early_stop,
        "stale_epochs": state.stale_epochs,
        "best_acc1": state.best_acc1,
        "best_model": state.best_model,
    }


def _stale(config: Config, state: TrainState) -> bool:
    """--early-stop's patience is used up. Decided from all-reduced figures only (best_acc1,
    stale_epochs), the same on every rank, so every rank stops after the same epoch."""
    return 0 < config.optim.early_stop <= state.stale_epochs


def fit(run: Run, state: TrainState) -> TrainState:
    config, reporter = run.config, run.reporter
    start, val = time.perf_counter(), None
    if state.epoch < config.optim.epochs and _stale(config, state):  # a run that stopped early
        reporter.info(
            f"--early-stop {config.optim.early_stop}: stopped early after epoch {state.epoch}, "
            f"best acc1 {state.best_acc1:.2f}; nothing to train (a larger --early-stop goes on)"
        )
        return state
    for epoch in range(state.epoch, config.optim.epochs):
        run.enter_epoch(epoch)
        if state.epoch_step == 0 or state.epoch_lr is None:  # else resumed mid-epoch
            state.epoch_lr = schedule_lr(run.optimizer)
        train = train_epoch(run, epoch, state)
        val, val_ema, per_class = _validate(run, state.global_step)
        lr, state.epoch_lr = state.epoch_lr, None
        state.epoch, state.epoch_step, state.train_sums = epoch + 1, 0, None
        # model_best.pt follows the better of the model and its average, and says which.
        candidates = {"model": val["acc1"], "model_ema": (val_ema or {}).get("acc1", -1.0)}
        best = max(candidates, key=candidates.get)
        is_best = candidates[best] > state.best_acc1
        if is_best:
            state.best_acc1, state.best_model = candidates[best], best
        state.stale_epochs = 0 if is_best else state.stale_epochs + 1
        # Recorded before the checkpoint: a run killed in between resumes from the previous
        # checkpoint, which drops these records (Reporter.keep_until) and records them again.
        at = {"epoch": state.epoch, "global_step": state.global_step}
        ema = [] if val_ema is None else [{"split": "val_ema", **at, **val_ema}]
        stopping = _stale(config, state) and state.epoch < config.optim.epochs
        early_stop = [_early_stop_record(config, state, at)] if stopping else []
        # The schedule's LR, and with LR groups (--layer-decay, --head-lr-scale) each one's, as
        # numbers of their own (lr_layer_0, ..., lr_head): columns and curves in every record.
        lrs = {"lr": lr, **{f"lr_{name}": v for name, v in group_lrs(run.optimizer, lr).items()}}
        reporter.record(
            {"split": "train", **at, **lrs, **train},
            {"split": "val", **at, **val},
            *ema,
            *early_stop,
            per_class=[{"split": r["split"], **at, **r} for r in per_class],
        )
        save(run, state, is_best)
        if train["data_wait"] > DATA_WAIT_WARNING:
            reporter.warn(
                f"{100 * train['data_wait']:.0f}% of the epoch went to waiting for data; "
                f"try more loader workers (-j, now {config.data.workers}), a smaller --image-size, "
                "or smaller images on faster storage"
            )
        ema_text, best_of = "", ""
        skipped_text = f"({train['skipped']} steps skipped) " if train["skipped"] else ""
        if val_ema is not None:  # and which of the two model_best.pt holds
            ema_text = f" | ema acc1 {val_ema['acc1']:.2f}"
            best_of = " (ema)" if state.best_model == "model_ema" else " (model)"
        reporter.info(
            f"epoch {state.epoch}/{config.optim.epochs} done: train loss "
            f"{shown(train['loss'], '.4f')} acc1 {shown(train['acc1'], '.2f')} "
            f"({train['samples_per_sec']:.1f} samples/s) {skipped_text}| val loss "
            f"{val['loss']:.4f} acc1 {val['acc1']:.2f} acc5 {val['acc5']:.2f} "
            f"({val['samples']} images){ema_text} | best acc1 {state.best_acc1:.2f}{best_of}"
        )
        if stopping:
            reporter.info(
                f"--early-stop {config.optim.early_stop}: no better val acc1 in "
                f"{state.stale_epochs} epochs, so training stops after epoch {state.epoch}"
            )
            break
    if val is None:
        reporter.info(
            f"nothing to train: {state.epoch} of {config.optim.epochs} epochs already done"
        )
    else:
        reporter.info(
            f"trained in {time.perf_counter() - start:.0f} s: val acc1 {val['acc1']:.2f} "
            f"(best {state.best_acc1:.2f}); checkpoints in {config.checkpoint.out_dir}"
        )
    run.stop.agreeing = False  # set by the first epoch's step loop (train_epoch)
    return state
