"""Composition root: a run resolves (resolve.py), builds, then fits (train/trainer.py), and
always tears down.

Building goes in order, so that a user error on any rank ends every rank: first what may fail
on some ranks only, each agreed (`agree`): the data, the model checked against the checkpoint,
the precision, the reporter; then collective work, reached by every rank: pretrained weights,
place the model (device, dtype, memory format) and wrap it by strategy (under fsdp, sharded
first, so that only the shards are placed), build the optimizer on the wrapped parameters
(under fsdp, the shards), restore the checkpoint into them.
"""

from pathlib import Path

import torch

from ddptrain.config import MEMORY_SETTINGS, Config
from ddptrain.config_layers import Layers
from ddptrain.data import fork_server
from ddptrain.data.loaders import Data, build_data
from ddptrain.distributed.collectives import agree, check_same
from ddptrain.distributed.env import DistEnv, SpawnSlot, init_distributed, teardown_distributed
from ddptrain.distributed.phases import Phases
from ddptrain.distributed.threads import too_many_workers, usable_cores
from ddptrain.errors import Stopped, first_line, peer_lost, report
from ddptrain.faults import Faults
from ddptrain.model.build import build_model, load_pretrained
from ddptrain.model.precision import DTYPES, Precision, run_precision
from ddptrain.model.providers import provider
from ddptrain.parallel import fsdp
from ddptrain.parallel.parallelize import (
    builds_on_meta,
    checkpoint_parts,
    compile_model,
    is_sharded,
    own_compile_cache,
    rewrapped,
    unwrap,
    will_shard,
    wrap,
)
from ddptrain.report.profile import StepProfiler
from ddptrain.report.progress import say
from ddptrain.report.reporter import Reporter
from ddptrain.report.summary import start_summary
from ddptrain.resolve import Resolved, resolve
from ddptrain.state.checkpointer import (
    Checkpointer,
    TrainState,
    check_compatible,
    check_fits,
    training_parts,
)
from ddptrain.state.data_facts import check_same_data
from ddptrain.state.files import checkpoint_bytes, room_warning
from ddptrain.state.lock import unlock_out_dir
from ddptrain.state.resume import check_continuable, check_trainable, roll_back
from ddptrain.train import trainer
from ddptrain.train.ema import build_ema
from ddptrain.train.finetune import fine_tuning
from ddptrain.train.loss import build_criterion
from ddptrain.train.optim import build_optimizer, keep_given, rebased, settings
from ddptrain.train.preempt import StopRequests
from ddptrain.train.schedule import fast_forward, no_warmup_warning


def train(
    config: Config, slot: SpawnSlot | None = None, layers: Layers | None = None
) -> TrainState:
    """Runs the configured job on this process. Importable: any launcher can call it. layers:
    what each layer of the config gave (config_layers.merge); none, for a Config built in code."""
    layers = layers or Layers()
    if config.data.workers > 0:
        fork_server.start()  # it imports what loader workers need while the run sets up
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
    faults = Faults.asked(env.rank)  # the test suite's, None unless it asks
    resolved = resolve(config, layers, env, locked=faults.setup if faults else lambda: None)
    config = resolved.config
    run = _build(resolved, env, phases, stop, faults)
    state = run.state
    ended_by = None  # what ended the run early, for the trackers' record of it
    try:
        if config.checkpoint.evaluate:
            return _evaluate_only(run, state)
        # rank 0 rewrites files there: a failure must end every rank
        agree(env, lambda: _go_on_from(state, resolved, env, run.reporter))
        run.reporter.start(run.summary)
        if env.is_main:
            run.reporter.info(_plan(config, env, run.data.num_classes, run.precision.amp))
        return trainer.fit(run, state)
    except BaseException as err:
        ended_by = err
        raise
    finally:
        if run.profiler is not None:
            run.profiler.close()
            if run.profiler.written:
                run.reporter.info(
                    f"--profile {config.report.profile}: trace in {run.profiler.path}"
                )
        run.reporter.close(ended_by)


def _build(
    resolved: Resolved, env: DistEnv, phases: Phases, stop: StopRequests, faults: Faults | None
) -> trainer.Run:
    """Every object of the run, in order. Steps that may fail on some ranks only are agreed
    one by one; the rest are collectives every rank reaches."""
    config, saved = resolved.config, resolved.saved
    loaders = agree(
        env,
        lambda: build_data(config, env, resolved.source, resolved.seed, resolved.leave_out),
    )
    model = agree(env, lambda: _model(resolved, loaders, env))
    precision = agree(env, lambda: run_precision(config, model, env.device))
    reporter = agree(env, lambda: _reporter(resolved, env))
    for line in [*resolved.warnings, precision.warning, *loaders.warnings]:
        if line:
            reporter.warn(line)
    for line in resolved.notes:
        reporter.info(line)
    position = resolved.start(loaders.steps_per_epoch)
    _check_same_everywhere(env, resolved, loaders, position, precision)

    if config.model.pretrained and saved is None:
        _load_pretrained(model, config, loaders, env, reporter)
    parameters = sum(p.numel() for p in model.parameters())
    # Before wrapping: DDP is built for the parameters that train where the run starts.
    layers, freezing = fine_tuning(
        config.optim, provider(config.model.arch), model, _saved_epoch(position, saved)
    )
    if freezing is not None and not config.model.pretrained and saved is None:
        reporter.warn(
            "--freeze-backbone without --pretrained: the frozen backbone keeps the random "
            "weights it was built with; give --pretrained [FILE]"
        )
    # Under fsdp the EMA averages into a twin of the model, sharded alike: its structure is
    # copied before sharding, as FSDP2 refuses to copy a sharded model.
    structure = (
        fsdp.meta_copy(model)
        if config.optim.model_ema and will_shard(env, config.parallel.strategy)
        else None
    )
    sharding = dict(
        arch=config.model.arch,
        amp_dtype=DTYPES[precision.amp],
        offload=config.parallel.fsdp_offload,
    )
    example = None if config.checkpoint.evaluate else _example(config, precision, env.device)
    model = wrap(
        model,
        env,
        gpu_pinned=config.launch.gpu is not None,
        strategy=config.parallel.strategy,
        **sharding,
        reshard_after_forward=config.parallel.reshard_after_forward,
        comm=config.parallel,
        example=example,
        place=lambda built: precision.place(built, env.device),
    )
    steps_per_epoch = loaders.steps_per_epoch
    optimizer, scheduler = build_optimizer(
        model, config.optim, steps_per_epoch, layers, frozen_too=freezing is not None
    )
    _warn_up_front(config, env, model, optimizer, steps_per_epoch, reporter)
    twin = None if structure is None else fsdp.shard_twin(structure, env, **sharding)
    ema = build_ema(unwrap(model), config.optim, env, steps_per_epoch, averaged=twin)
    summary = start_summary(
        config, env, loaders, precision, parameters, steps_per_epoch, resolved.resume
    )
    parts = training_parts(
        unwrap(model), optimizer, scheduler, env, precision.scaler, sharded=is_sharded(model)
    )
    if ema is not None:
        parts["model_ema"] = ema
    parts.update(checkpoint_parts(model, env))  # PowerSGD's state under --ddp-comm-hook powersgd
    meta, record = _records(config, env, loaders, precision, resolved.seed, summary)
    checkpointer = Checkpointer(
        env,
        resolved.out_dir,
        parts,
        meta,
        record,
        config.checkpoint.keep_last,
        sharded_format=config.checkpoint.checkpoint_format == "sharded",
        mark=phases.within_step,
        every=config.checkpoint.checkpoint_every,
    )
    state = _restore(checkpointer, saved, scheduler, position)
    if ema is not None and saved is not None and "model_ema" not in saved:
        ema.start_from(unwrap(model))  # --model-ema new on resume: not from the built weights
    if faults is not None:
        faults.install(unwrap(model))
    if precision.compile:
        own_compile_cache(env.local_rank)
        model = compile_model(model)
    return trainer.Run(
        config=config,
        env=env,
        data=loaders,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        reporter=reporter,
        seed=resolved.seed,
        precision=precision,
        checkpointer=None if config.checkpoint.evaluate else checkpointer,
        stop=stop,
        criterion=build_criterion(config.optim, loaders.num_classes),
        ema=ema,
        phases=phases,
        profiler=_profiler(config, env, resolved.out_dir),
        faults=faults,
        state=state,
        summary=summary,
        freezing=freezing,
        rewrap=lambda m: rewrapped(m, config.parallel, example, sharding["amp_dtype"]),
    )


def _saved_epoch(position: TrainState, saved: dict | None) -> int:
    """The epoch whose state `saved` holds: at an epoch's end (step 0 of the next), the epoch
    just done. Its optimizer state then has no entry for a backbone that epoch kept frozen
    (--unfreeze-epoch), so the parts are built and restored frozen as they were, and fit's
    enter_epoch unfreezes and rewraps as the uninterrupted run did."""
    if saved is not None and position.epoch_step == 0 and position.epoch > 0:
        return position.epoch - 1
    return position.epoch


def _check_same_everywhere(
    env: DistEnv, resolved: Resolved, loaders: Data, position: TrainState, precision: Precision
) -> None:
    """What every rank must have alike before the collectives start."""
    check_same(
        env,
        {
            "train images": loaders.train_sampler.num_samples if loaders.train_sampler else 0,
            "val images": loaders.num_val,
            "classes": loaders.class_to_idx,
            "resumed position": (position.epoch, position.epoch_step, position.global_step),
            "data seed": resolved.seed,
            "data files": loaders.facts,
        },
    )
    # fsdp's collectives, and the meaning of a checkpoint, need one precision on every rank
    fix = "--amp auto chooses by each node's CPU or GPU: give --amp when the nodes differ"
    check_same(env, {"--amp": precision.amp}, fix)


def _model(resolved: Resolved, loaders: Data, env: DistEnv) -> torch.nn.Module:
    """The model for the data's classes, checked against the checkpoint it resumes."""
    config, saved, resume = resolved.config, resolved.saved, resolved.resume
    model = build_model(
        config.model.arch,
        loaders.num_classes,
        config.data.image_size,
        config.model.pretrained,
        meta=builds_on_meta(env, config.parallel.strategy),
        drop_path=config.model.drop_path,
    )
    if config.model.grad_checkpointing:  # before fsdp, which subclasses the blocks again
        provider(config.model.arch).set_grad_checkpointing(model, config.model.arch)
    if saved is not None:
        check_compatible(saved, resume, config.model.arch, loaders.class_to_idx)
        check_fits(saved, resume, model)
        if not config.checkpoint.evaluate:  # evaluating on other data is fine
            check_same_data(saved, loaders.facts, resume)
            check_trainable(saved, resume)
            check_continuable(saved, config, resume)
    return model


def _reporter(resolved: Resolved, env: DistEnv) -> Reporter:
    config = resolved.config
    done = TrainState.from_checkpoint(resolved.saved or {"epoch": config.checkpoint.start_epoch})
    return Reporter(
        env,
        resolved.out_dir,
        config.report.progress,
        config.report.tensorboard,
        done.global_step,
        config.checkpoint.evaluate,
        config.report.log_to,
        config.to_dict(),
    )


def _load_pretrained(model, config: Config, loaders: Data, env: DistEnv, reporter) -> None:
    """--pretrained, for a fresh run. A collective."""
    # Evaluated, the weights must know the data's classes: a new head would be random.
    classes = sorted(loaders.class_to_idx, key=loaders.class_to_idx.get)
    fresh = load_pretrained(
        model,
        config.model.arch,
        env,
        source=config.model.pretrained,
        classes=classes if config.checkpoint.evaluate else None,
        image_size=config.data.image_size,
    )
    if fresh:
        origin = "" if config.model.pretrained is True else f" from {config.model.pretrained}"
        reporter.info(f"pretrained {config.model.arch}{origin}: new weights for {', '.join(fresh)}")


def _warn_up_front(config, env, model, optimizer, steps_per_epoch: int, reporter) -> None:
    """What rank 0 says before the first step, while it can still help."""
    if not env.is_main:
        return
    if not config.checkpoint.evaluate:  # before the first save
        out_dir = Path(config.checkpoint.out_dir)
        room = checkpoint_bytes(unwrap(model), optimizer)
        for line in (
            room_warning(out_dir, room, config.checkpoint.keep_last),
            no_warmup_warning(config.optim, steps_per_epoch),
        ):
            if line:
                reporter.warn(line)
    crowded = too_many_workers(config.data.workers, env.local_world_size, usable_cores())
    if crowded:
        reporter.warn(crowded)


def _go_on_from(state: TrainState, resolved: Resolved, env: DistEnv, reporter: Reporter) -> None:
    """Once every rank has set up, the out-dir continues from where this run starts: what an
    earlier run recorded and saved after it is dropped (records after a crash; checkpoints
    that --resume auto passed over as damaged)."""
    reporter.keep_until(state.epoch)
    if not (env.is_main and resolved.resume is not None):
        return
    out_dir = resolved.out_dir
    dropped = roll_back(out_dir, state.global_step)
    if dropped:
        reporter.warn(
            f"--resume auto: continuing from global step {state.global_step}, so the damaged "
            f"later checkpoints of {out_dir} are removed: {', '.join(p.name for p in dropped)}"
        )


def _example(config: Config, precision: Precision, device: torch.device) -> torch.Tensor:
    """Two images as training feeds them (two: BatchNorm cannot train on one at 1 x 1)."""
    size = config.data.image_size
    return precision.inputs(torch.zeros(2, 3, size, size, dtype=torch.uint8), device)


def _profiler(config: Config, env: DistEnv, out_dir: Path) -> StepProfiler | None:
    if not config.report.profile or not env.is_main or config.checkpoint.evaluate:
        return None
    return StepProfiler(config.report.profile, out_dir, env.device)


def _plan(config: Config, env: DistEnv, num_classes: int, amp: str) -> str:
    """The planner's line for this run: its strategy's per-rank memory, and on CUDA, where the
    device's memory is known, whether it fits and if not, what would (a traced step on fake
    tensors: seconds, once per model and batch, as traces are kept in the user cache)."""
    from ddptrain.tools.plan import Workload, plan_line

    memory = None
    if env.device.type == "cuda":
        memory = torch.cuda.get_device_properties(env.device.index).total_memory
    workload = Workload(
        config.model.arch,
        num_classes,
        env.world_size,
        config.optim.batch_size // env.world_size,
        config.data.image_size,
        amp,
        **_memory_settings(config),
    )
    try:
        line = plan_line(
            workload,
            config.parallel.strategy,
            memory,
            # The other ranks wait for rank 0 in their first collective, for --dist-timeout.
            seconds=config.launch.dist_timeout / 2,
        )
    except Exception as err:  # planning is advice: a model it cannot trace still trains
        return f"plan: not available ({first_line(err)})"
    if config.parallel.fsdp_offload:  # a trace holds everything on one device
        line += "; --fsdp-offload keeps the model state in host memory, not on the device"
    return line


def _memory_settings(config: Config) -> dict:
    """The run's MEMORY_SETTINGS as the planner takes them. Its --freeze-backbone is for the
    whole run: a backbone that --unfreeze-epoch trains later is planned unfrozen, the larger of
    the run's two parts (gradients and optimizer state for every parameter)."""
    given = config.to_dict()
    memory = {name: given[name] for name in MEMORY_SETTINGS}
    memory["freeze_backbone"] = config.optim.freeze_backbone and config.optim.unfreeze_epoch is None
    return memory


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


def _records(config: Config, env: DistEnv, loaders: Data, precision, seed: int, summary: dict):
    """What every checkpoint carries besides state, and what config.json holds."""
    # The resolved precision, so a resumed run keeps it unless flags say otherwise.
    settings = {**config.to_dict(), **precision.settings()}
    meta = {
        "arch": config.model.arch,
        "num_classes": loaders.num_classes,
        "class_to_idx": loaders.class_to_idx,
        "config": settings,
        "data_seed": seed,  # a resumed run continues the same data order
        "data_facts": loaders.facts,  # and must resume on the same data (check_same_data)
    }
    runtime = {
        "world_size": env.world_size,
        "per_rank_batch": config.optim.batch_size // env.world_size,
        "device": str(env.device),
        "data_seed": seed,
        "summary": summary,
    }
    return meta, {**settings, "resolved": runtime}


def _evaluate_only(run: trainer.Run, state: TrainState) -> TrainState:
    val, classes = run.evaluate(run.model, "evaluation", state.global_step)
    record = {"split": "val", "epoch": state.epoch, "global_step": state.global_step}
    run.reporter.record({**record, **val}, per_class=[{**record, **classes}])
    run.reporter.info(
        f"val: loss {val['loss']:.4f} acc1 {val['acc1']:.2f} acc5 {val['acc5']:.2f} "
        f"({val['samples']} images)"
    )
    return state
