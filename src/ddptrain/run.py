"""Composition root: builds every object of a run in order and always tears down.

Setup runs in three phases so that a user error on any rank ends every rank:
1. decisions rank 0 makes for all (the data seed, which checkpoint to resume);
2. local work that may fail on some ranks only (data checks, reading the checkpoint and
   checking that it fits, the out-dir), ended by `agree`;
3. collective work, reached by every rank, in this order: pretrained weights, place the model
   (device, dtype, memory format) and wrap it by strategy (under fsdp, sharded first, so that
   only the shards are placed), build the optimizer on the wrapped parameters (under fsdp, the
   shards), restore the checkpoint into them.
"""

import os
import random
import secrets
from pathlib import Path

import numpy as np
import torch

from ddptrain.config import MEMORY_SETTINGS, Config, inert_flags
from ddptrain.config_layers import Layers, check_batch_divides_early, resumed, settled
from ddptrain.data.check import images_to_leave_out
from ddptrain.data.loaders import Data, build_data
from ddptrain.data.synth import ensure_builtin
from ddptrain.distributed.collectives import agree, check_same, from_rank0
from ddptrain.distributed.env import DistEnv, SpawnSlot, init_distributed, teardown_distributed
from ddptrain.distributed.phases import Phases
from ddptrain.distributed.threads import too_many_workers, usable_cores
from ddptrain.errors import Stopped, UserError, first_line, peer_lost, report
from ddptrain.faults import Faults
from ddptrain.model import fsdp
from ddptrain.model.build import build_model, load_pretrained
from ddptrain.model.parallelize import (
    Communication,
    builds_on_meta,
    checkpoint_parts,
    compile_model,
    is_sharded,
    unwrap,
    will_shard,
    wrap,
)
from ddptrain.model.precision import DTYPES, Precision, resolve_precision
from ddptrain.report.profile import StepProfiler
from ddptrain.report.progress import counting, say
from ddptrain.report.records import require_tensorboard
from ddptrain.report.reporter import Reporter, warn
from ddptrain.report.summary import start_summary
from ddptrain.state.checkpointer import (
    Checkpointer,
    TrainState,
    check_compatible,
    check_fits,
    training_parts,
)
from ddptrain.state.data_facts import check_same_data
from ddptrain.state.files import (
    checkpoint_bytes,
    room_warning,
)
from ddptrain.state.lock import lock_out_dir, unlock_out_dir
from ddptrain.state.resume import (
    check_continuable,
    check_out_dir,
    check_position,
    check_same_leave_out,
    check_trainable,
    find_resume,
    kept_seed,
    load_resumed,
    roll_back,
    saved_data,
)
from ddptrain.train import trainer
from ddptrain.train.ema import build_ema
from ddptrain.train.loss import build_criterion
from ddptrain.train.optim import build_optimizer, keep_given, rebased, settings
from ddptrain.train.preempt import StopRequests
from ddptrain.train.schedule import fast_forward, no_warmup_warning


def train(
    config: Config, slot: SpawnSlot | None = None, layers: Layers | None = None
) -> TrainState:
    """Runs the configured job on this process. Importable: any launcher can call it. layers:
    what a config file and the flags gave (cli.parse); None: nothing, a Config made in code."""
    layers = layers or Layers()
    env = init_distributed(config.launch, config.data.workers, slot, say)
    phases = Phases(env)
    try:
        # From here, not from the first step: a SIGTERM or SIGUSR1 while the data is listed
        # or the model built ends this rank with its line and tells the others (phases),
        # where the signal's default action killed it without a word.
        with StopRequests(env) as stop:
            return _train(config, layers, env, phases, stop)
    except BaseException as err:
        if peer_lost(err) and (stalled := phases.stalled()):
            err.add_note(stalled)  # which ranks did not arrive, and where they were
        # The line goes out before the teardown: a launcher ends the other ranks as soon as
        # one exits, and every rank that failed should have said why by then.
        phases.ending = True
        code = report(err)
        if not (isinstance(err, Stopped) and err.agreed):  # else every rank is stopping already
            phases.abort()
        if code is not None:
            phases.end_together()
        raise
    finally:
        phases.close()
        unlock_out_dir()  # taken in _train
        teardown_distributed()


def _train(
    config: Config, layers: Layers, env: DistEnv, phases: Phases, stop: StopRequests
) -> TrainState:
    check_batch_divides_early(config, layers, env.world_size)
    _check_offload_clipping(config, env)
    out_dir = Path(config.out_dir)
    if not config.evaluate:  # one run per out-dir, before anything reads or writes it
        unlocked = agree(env, lambda: lock_out_dir(out_dir) if env.is_main else None)
        if unlocked:  # a file system without locks
            warn(env, unlocked)
    faults = Faults.asked(env.rank)  # the test suite's, None unless it asks
    if faults is not None:
        faults.setup()
    seed = from_rank0(env, lambda: _data_seed(config))
    resume = from_rank0(
        env, lambda: find_resume(config.resume, out_dir, config.evaluate, lambda w: warn(env, w))
    )
    seeded = config.seed is not None
    if seeded:
        _seed_everything(config.seed, env)

    # --verify-images, --bad-images skip, of DATA as given or as the resumed run's
    data = config.data.root
    if data is None and resume is not None and config.checks_images:
        data = from_rank0(env, lambda: saved_data(resume))
    leave_out = images_to_leave_out(config.replace(data=data), env, say, counting)
    config, loaders, model, precision, saved, seed, reporter = agree(
        env, lambda: _prepare(config, layers, env, out_dir, seed, resume, leave_out)
    )
    if config.seed is not None and not seeded:  # the checkpoint's --seed: its kernels too
        _seed_everything(config.seed, env)
    train_samples = loaders.train_sampler.num_samples if loaders.train_sampler else 0
    position = _start(saved, config, loaders)
    check_same(
        env,
        {
            "train images": train_samples,
            "val images": loaders.num_val,
            "classes": loaders.class_to_idx,
            "resumed position": (position.epoch, position.epoch_step, position.global_step),
            "data seed": seed,
            "data files": loaders.facts,
        },
    )
    # fsdp's collectives, and the meaning of a checkpoint, need one precision on every rank
    fix = "--amp auto chooses by each node's CPU or GPU: give --amp when the nodes differ"
    check_same(env, {"--amp": precision.amp}, fix)

    if config.pretrained and saved is None:
        # Evaluated, the weights must know the data's classes: a new head would be random.
        classes = sorted(loaders.class_to_idx, key=loaders.class_to_idx.get)
        fresh = load_pretrained(
            model,
            config.arch,
            env,
            source=config.pretrained,
            classes=classes if config.evaluate else None,
        )
        if fresh:
            origin = "" if config.pretrained is True else f" from {config.pretrained}"
            reporter.info(f"pretrained {config.arch}{origin}: new weights for {', '.join(fresh)}")
    parameters = sum(p.numel() for p in model.parameters())
    # Under fsdp the EMA averages into a twin of the model, sharded alike: its structure is
    # copied before sharding, as FSDP2 refuses to copy a sharded model.
    structure = (
        fsdp.meta_copy(model) if config.model_ema and will_shard(env, config.strategy) else None
    )
    sharding = dict(arch=config.arch, amp_dtype=DTYPES[precision.amp], offload=config.fsdp_offload)
    model = wrap(
        model,
        env,
        gpu_pinned=config.gpu is not None,
        strategy=config.strategy,
        **sharding,
        reshard_after_forward=config.reshard_after_forward,
        comm=Communication.of(config),
        example=None if config.evaluate else _example(config, precision, env.device),
        place=lambda built: precision.place(built, env.device),
    )
    steps_per_epoch = loaders.steps_per_epoch
    optimizer, scheduler = build_optimizer(model, config.optim, steps_per_epoch)
    if env.is_main and not config.evaluate:  # before the first save, while a warning helps
        no_room = room_warning(
            out_dir, checkpoint_bytes(unwrap(model), optimizer), config.keep_last
        )
        if no_room:
            reporter.warn(no_room)
        no_warmup = no_warmup_warning(config.optim, steps_per_epoch)
        if no_warmup:
            reporter.warn(no_warmup)
    if env.is_main:
        crowded = too_many_workers(config.workers, env.local_world_size, usable_cores())
        if crowded:
            reporter.warn(crowded)
    twin = None if structure is None else fsdp.shard_twin(structure, env, **sharding)
    ema = build_ema(unwrap(model), config.optim, env, steps_per_epoch, averaged=twin)
    summary = start_summary(config, env, loaders, precision, parameters, steps_per_epoch, resume)
    meta, record = _records(config, env, loaders, precision, seed, summary)
    parts = training_parts(
        unwrap(model), optimizer, scheduler, env, precision.scaler, sharded=is_sharded(model)
    )
    if ema is not None:
        parts["model_ema"] = ema
    parts.update(checkpoint_parts(model, env))  # PowerSGD's state under --ddp-comm-hook powersgd
    checkpointer = Checkpointer(
        env,
        out_dir,
        parts,
        meta,
        record,
        config.keep_last,
        sharded_format=config.checkpoint_format == "sharded",
        mark=phases.within_step,
    )
    state = _restore(checkpointer, saved, scheduler, position)
    if ema is not None and saved is not None and "model_ema" not in saved:
        ema.start_from(unwrap(model))  # --model-ema new on resume: not from the built weights
    if faults is not None:
        faults.install(unwrap(model))
    if precision.compile:
        model = compile_model(model)
    run = trainer.Run(
        config=config,
        env=env,
        data=loaders,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        reporter=reporter,
        seed=seed,
        precision=precision,
        checkpointer=None if config.evaluate else checkpointer,
        stop=stop,
        criterion=build_criterion(config.optim, loaders.num_classes),
        ema=ema,
        phases=phases,
        profiler=_profiler(config, env, out_dir),
        faults=faults,
    )
    try:
        if config.evaluate:
            return _evaluate_only(run, state)
        # rank 0 rewrites files there: a failure must end every rank
        agree(env, lambda: _go_on_from(state, resume is not None, env, out_dir, reporter))
        reporter.start(summary)
        if env.is_main:
            reporter.info(_plan(config, env, loaders.num_classes, precision.amp))
        return trainer.fit(run, state)
    finally:
        if run.profiler is not None:
            run.profiler.close()
            if run.profiler.written:
                reporter.info(f"--profile {config.profile}: trace in {run.profiler.path}")
        reporter.close()


def _go_on_from(
    state: TrainState, resumed: bool, env: DistEnv, out_dir: Path, reporter: Reporter
) -> None:
    """Once every rank has set up, the out-dir continues from where this run starts: what an
    earlier run recorded and saved after it is dropped (records after a crash; checkpoints
    that --resume auto passed over as damaged)."""
    reporter.keep_until(state.epoch)
    if not (env.is_main and resumed):
        return
    dropped = roll_back(out_dir, state.global_step)
    if dropped:
        reporter.warn(
            f"--resume auto: continuing from global step {state.global_step}, so the damaged "
            f"later checkpoints of {out_dir} are removed: {', '.join(p.name for p in dropped)}"
        )


def _example(config: Config, precision: Precision, device: torch.device) -> torch.Tensor:
    """Two images as training feeds them (two: BatchNorm cannot train on one at 1 x 1)."""
    size = config.image_size
    return precision.inputs(torch.zeros(2, 3, size, size, dtype=torch.uint8), device)


def _profiler(config: Config, env: DistEnv, out_dir: Path) -> StepProfiler | None:
    if not config.profile or not env.is_main or config.evaluate:
        return None
    return StepProfiler(config.profile, out_dir, env.device)


def _plan(config: Config, env: DistEnv, num_classes: int, amp: str) -> str:
    """The planner's line for this run: its strategy's per-rank memory, and on CUDA, where the
    device's memory is known, whether it fits and if not, what would (a traced step on fake
    tensors: seconds, once per model and batch, as traces are kept in the user cache)."""
    from ddptrain.tools.plan import Workload, plan_line

    memory = None
    if env.device.type == "cuda":
        memory = torch.cuda.get_device_properties(env.device.index).total_memory
    workload = Workload(
        config.arch,
        num_classes,
        env.world_size,
        config.batch_size // env.world_size,
        config.image_size,
        amp,
        **{name: getattr(config, name) for name in MEMORY_SETTINGS},
    )
    try:
        line = plan_line(
            workload,
            config.strategy,
            memory,
            # The other ranks wait for rank 0 in their first collective, for --dist-timeout.
            seconds=config.dist_timeout / 2,
        )
    except Exception as err:  # planning is advice: a model it cannot trace still trains
        return f"plan: not available ({first_line(err)})"
    if config.fsdp_offload:  # a trace holds everything on one device
        line += "; --fsdp-offload keeps the model state in host memory, not on the device"
    return line


def _start(saved: dict | None, config: Config, loaders: Data) -> TrainState:
    """Where this run starts: its checkpoint's position, else after the epochs --start-epoch
    says are done, and their steps (checkpoint numbers, the schedule, the EMA warmup)."""
    if saved is not None:
        return TrainState.from_checkpoint(saved)
    return TrainState(
        epoch=config.start_epoch, global_step=config.start_epoch * loaders.steps_per_epoch
    )


def _restore(checkpointer, saved, scheduler, start: TrainState) -> TrainState:
    """The checkpoint's state in every part, or `start` (_start) for a fresh run. A
    collective."""
    if saved is None:
        fast_forward(scheduler, start.global_step)
        return start
    # Checkpoints of format 1 stepped their schedule per epoch: replay the per-step one instead.
    per_epoch_schedule = int(saved.get("format_version", 1)) < 2
    built = settings(scheduler.optimizer)
    state = checkpointer.restore(saved, skip={"scheduler"} if per_epoch_schedule else set())
    bases = keep_given(scheduler.optimizer, built, None if per_epoch_schedule else scheduler)
    if state.epoch_lr is not None:  # the record of the epoch under way, at the new base too
        state.epoch_lr = rebased(state.epoch_lr, *bases[0])
    if per_epoch_schedule:
        for group in scheduler.optimizer.param_groups:  # from the start, not the restored LR
            group["lr"] = group["initial_lr"]
        fast_forward(scheduler, state.global_step)
    return state


def _check_offload_clipping(config: Config, env: DistEnv) -> None:
    """torch 2.14's clip_grad_norm_ sums the norms of the gradients' shards, in host memory
    under --fsdp-offload, over the device's process group: NCCL has no CPU backend, so every
    rank would fail at the first step ("No backend type associated with device type cpu",
    pytorch/pytorch#148532). Refused before anything starts. On the CPU the group is gloo's."""
    offloaded = config.fsdp_offload and will_shard(env, config.strategy)
    if offloaded and config.clip_grad_norm is not None and env.device.type != "cpu":
        raise UserError(
            f"--clip-grad-norm does not run with --fsdp-offload on {env.device.type}: torch "
            "sums the offloaded gradients' norms over the device's process group, which takes "
            "no host-memory tensors; drop one of the two"
        )


def _records(config: Config, env: DistEnv, loaders: Data, precision, seed: int, summary: dict):
    """What every checkpoint carries besides state, and what config.json holds."""
    # The resolved precision, so a resumed run keeps it unless flags say otherwise.
    settings = {**config.to_dict(), **precision.settings()}
    meta = {
        "arch": config.arch,
        "num_classes": loaders.num_classes,
        "class_to_idx": loaders.class_to_idx,
        "config": settings,
        "data_seed": seed,  # a resumed run continues the same data order
        "data_facts": loaders.facts,  # and must resume on the same data (check_same_data)
    }
    runtime = {
        "world_size": env.world_size,
        "per_rank_batch": config.batch_size // env.world_size,
        "device": str(env.device),
        "data_seed": seed,
        "summary": summary,
    }
    return meta, {**settings, "resolved": runtime}


def _data_seed(config: Config) -> int:
    """Orders and augments the data, the same on every rank: --seed, or a fresh random one."""
    return config.seed if config.seed is not None else secrets.randbits(62)


def _seed_everything(seed: int, env: DistEnv) -> None:
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # needed by deterministic cuBLAS
    random.seed(seed + env.rank)
    np.random.seed((seed + env.rank) % 2**32)
    torch.manual_seed(seed + env.rank)
    # warn_only: a model whose op has no deterministic kernel still trains, with a warning.
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False


def _prepare(
    config: Config,
    layers: Layers,
    env: DistEnv,
    out_dir: Path,
    seed: int,
    resume: Path | None,
    leave_out: frozenset[str],
):
    """Everything that may fail on some ranks only. No collectives in here."""
    if env.is_main:
        check_out_dir(out_dir, resume, config.evaluate, config.resume == "auto")
    saved = None if resume is None else load_resumed(resume)
    if saved is not None:
        seed = int(saved.get("data_seed", seed))
        # The checkpoint's settings under what the flags and --config gave.
        given, config = config, resumed(config, layers, saved.get("config"))
        if not config.evaluate:  # evaluating another batch or other data is fine
            check_position(saved, config)
            check_same_leave_out(given, config, resume)
        _check_offload_clipping(config, env)  # with the checkpoint's settings too
    config = settled(config)
    config.check_batch_divides(env.world_size)  # -b is the checkpoint's unless given
    if config.tensorboard and not config.evaluate:  # eval writes no events
        require_tensorboard()  # on every rank, so that every rank stops when it is missing
    loaders = build_data(config, env, _data_root(config, env), seed, leave_out)
    model = build_model(
        config.arch,
        loaders.num_classes,
        config.image_size,
        config.pretrained,
        meta=builds_on_meta(env, config.strategy),
    )
    if saved is not None:
        check_compatible(saved, resume, config.arch, loaders.class_to_idx)
        check_fits(saved, resume, model)
        if not config.evaluate:  # evaluating on other data is fine
            check_same_data(saved, loaders.facts, resume)
            check_trainable(saved, resume)
            check_continuable(saved, config, resume)
    seeded = config.optim.seed is not None
    precision = resolve_precision(
        config.model, None, model, env.device, image_size=config.data.image_size, seeded=seeded
    )
    done = TrainState.from_checkpoint(saved or {"epoch": config.start_epoch})
    reporter = Reporter(
        env, out_dir, config.progress, config.tensorboard, done.global_step, config.evaluate
    )
    flags = layers.on_command_line
    kept = None if saved is None or config.evaluate else kept_seed(config, saved, flags)
    for line in [*inert_flags(config, flags), kept, precision.warning, *loaders.warnings]:
        if line:
            reporter.warn(line)
    if saved is None:
        if config.evaluate and not config.pretrained:
            raise UserError(f"--evaluate: no checkpoint to evaluate in {out_dir}")
        if config.resume == "auto":
            reporter.info(f"--resume auto: no checkpoint in {out_dir}, starting fresh")
    else:
        reporter.info(
            f"resumed from {resume} (epoch {done.epoch}, step {done.epoch_step} of the "
            f"next, best acc1 {done.best_acc1:.2f})"
        )
    return config, loaders, model, precision, saved, seed, reporter


def _data_root(config: Config, env: DistEnv) -> Path | None:
    if config.dummy:
        return None
    if config.data.root is None:
        return ensure_builtin(log=say if env.is_main else None)
    root = Path(config.data.root)
    if not root.is_dir():
        raise UserError(
            f"DATA: {root} is not a directory (expected an ImageFolder root with train/ and val/)"
        )
    return root


def _evaluate_only(run: trainer.Run, state: TrainState) -> TrainState:
    val = run.evaluate(run.model, "evaluation", state.global_step)
    record = {"split": "val", "epoch": state.epoch, "global_step": state.global_step}
    run.reporter.record({**record, **val})
    run.reporter.info(
        f"val: loss {val['loss']:.4f} acc1 {val['acc1']:.2f} acc5 {val['acc5']:.2f} "
        f"({val['samples']} images)"
    )
    return state
