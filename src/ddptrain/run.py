"""Composition root: builds every object of a run in order and always tears down.

Setup runs in three phases so that a user error on any rank ends every rank:
1. decisions rank 0 makes for all (the data seed, which checkpoint to resume);
2. local work that may fail on some ranks only (data checks, reading the checkpoint, the
   out-dir), ended by `distributed.agree`;
3. collective work (pretrained download, DDP wrapping), reached by every rank.
"""

import os
import random
import secrets
from pathlib import Path

import numpy as np
import torch

from ddptrain.config import Config
from ddptrain.data.check import images_to_leave_out
from ddptrain.data.loaders import Data, build_data
from ddptrain.data.synth import ensure_builtin
from ddptrain.dist.collectives import agree, check_same, from_rank0
from ddptrain.dist.env import DistEnv, SpawnSlot, init_distributed, teardown_distributed
from ddptrain.errors import UserError
from ddptrain.model.build import build_model, load_pretrained
from ddptrain.model.parallelize import wrap
from ddptrain.model.precision import resolve_precision
from ddptrain.report.metrics import MetricsLog
from ddptrain.state.data_facts import check_same_data
from ddptrain.state.files import (
    LATEST,
    TrainState,
    check_compatible,
    checkpoint_bytes,
    load,
    numbered,
    remove_stale_temp_files,
    resolve,
    restore,
    warn_if_no_room,
)
from ddptrain.state.lock import lock_out_dir, unlock_out_dir
from ddptrain.train import trainer
from ddptrain.train.optim import build_optimizer, fast_forward
from ddptrain.train.preempt import StopRequests


def train(config: Config, slot: SpawnSlot | None = None) -> TrainState:
    """Runs the configured job on this process. Importable: any launcher can call it."""
    env = init_distributed(config, slot)
    try:
        return _train(config, env)
    finally:
        unlock_out_dir()  # taken in _train
        teardown_distributed()


def _train(config: Config, env: DistEnv) -> TrainState:
    config.check_batch_divides(env.world_size)
    out_dir = Path(config.out_dir)
    if not config.evaluate:  # one run per out-dir, before anything reads or writes it
        agree(env, lambda: lock_out_dir(out_dir) if env.is_main else None)
    seed = from_rank0(env, lambda: _data_seed(config))
    resume = from_rank0(env, lambda: resolve(config.resume, out_dir))
    if config.seed is not None:
        _seed_everything(config.seed, env)

    leave_out = images_to_leave_out(config, env)  # --verify-images, --bad-images skip
    loaders, model, optimizer, scheduler, state, precision, seed = agree(
        env, lambda: _prepare(config, env, out_dir, seed, resume, leave_out)
    )
    if env.is_main and not config.evaluate:  # before the first save, while a warning helps
        warn_if_no_room(out_dir, checkpoint_bytes(model, optimizer), config.keep_last)
    train_samples = loaders.train_sampler.num_samples if loaders.train_sampler else 0
    check_same(
        env,
        {
            "train images": train_samples,
            "val images": loaders.num_val,
            "classes": loaders.class_to_idx,
            "resumed position": (state.epoch, state.epoch_step, state.global_step),
            "data seed": seed,
            "data files": loaders.facts,
        },
    )

    if config.pretrained and resume is None:
        load_pretrained(model, config.arch, env)
    model = wrap(model, env, gpu_pinned=config.gpu is not None)
    if precision.compile:
        model = torch.compile(model)
    meta, resolved = _records(config, env, loaders, precision, seed)
    log = MetricsLog(out_dir, enabled=env.is_main)
    with StopRequests(env) as stop:
        run = trainer.Run(
            config=config,
            env=env,
            data=loaders,
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            meta=meta,
            log=log,
            seed=seed,
            precision=precision,
            resolved_config=resolved,
            stop=stop,
        )
        if config.evaluate:
            return _evaluate_only(run, state)
        if env.is_main:
            print(
                f"training {config.arch} on {loaders.num_classes} classes, {env.world_size} "
                f"rank(s) on {env.device.type}, global batch {config.batch_size}, "
                f"epochs {state.epoch}->{config.epochs}",
                flush=True,
            )
        return trainer.fit(run, state)


def _records(config: Config, env: DistEnv, loaders: Data, precision, seed: int):
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
    env: DistEnv,
    out_dir: Path,
    seed: int,
    resume: Path | None,
    leave_out: frozenset[str],
):
    """Everything that may fail on some ranks only. No collectives in here."""
    if env.is_main:
        _check_out_dir(out_dir, resume, config.evaluate, config.resume == "auto")
    saved = None if resume is None else _load(resume)
    if saved is not None:
        seed = int(saved.get("data_seed", seed))
        _check_position(saved, config)
    loaders = build_data(config, env, _data_root(config, env), seed, leave_out)
    if saved is not None:
        check_compatible(saved, resume, config.arch, loaders.class_to_idx)
    if saved is not None and not config.evaluate:  # evaluating on other data is fine
        check_same_data(saved, loaders.facts, resume)
    saved_config = None if saved is None else saved.get("config")
    model = build_model(config.arch, loaders.num_classes, config.image_size, config.pretrained)
    precision = resolve_precision(config, saved_config, model, env.device)
    # On the device before the optimizer exists, so restored optimizer state lands there too.
    model = precision.place(model, env.device)
    optimizer, scheduler = build_optimizer(model, config)
    if saved is None:
        if config.evaluate and not config.pretrained:
            raise UserError(f"--evaluate: no checkpoint to evaluate in {out_dir}")
        if config.resume == "auto" and env.is_main:
            print(f"--resume auto: no checkpoint in {out_dir}, starting fresh", flush=True)
        fast_forward(scheduler, config.start_epoch)
        state = TrainState(epoch=config.start_epoch)
    else:
        state = restore(saved, model, optimizer, scheduler, precision.scaler)
        if env.is_main:
            print(
                f"resumed from {resume} (epoch {state.epoch}, step {state.epoch_step} of the "
                f"next, best acc1 {state.best_acc1:.2f})",
                flush=True,
            )
    if env.is_main and not config.evaluate:
        MetricsLog(out_dir, enabled=True).keep_until(state.epoch)
    return loaders, model, optimizer, scheduler, state, precision, seed


def _load(path: Path) -> dict:
    try:
        return load(path)
    except UserError as err:
        raise UserError(f"--resume: {err}") from None


def _check_position(saved: dict, config: Config) -> None:
    """A checkpoint taken mid-epoch continues the epoch's sample order at step x global batch:
    that position only exists for the same global batch."""
    saved_batch = saved.get("config", {}).get("batch_size")
    if saved.get("epoch_step") and saved_batch != config.batch_size:
        raise UserError(
            f"--batch-size {config.batch_size}: the checkpoint stopped mid-epoch with global "
            f"batch {saved_batch}; resume with -b {saved_batch} (any number of ranks)"
        )


def _check_out_dir(out_dir: Path, resume: Path | None, evaluate: bool, auto: bool) -> None:
    """A writable out-dir, holding no checkpoint but the one this run continues."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UserError(f"--out-dir {out_dir}: {err.strerror}") from None
    if not os.access(out_dir, os.W_OK):
        raise UserError(f"--out-dir {out_dir} is not writable")
    if evaluate:
        return
    remove_stale_temp_files(out_dir)
    earlier = [out_dir / LATEST, *numbered(out_dir)]
    earlier = [p for p in earlier if p.exists()]
    continues = resume is not None and any(p.samefile(resume) for p in earlier)
    if earlier and not continues and auto:
        raise UserError(
            f"--resume auto: no usable checkpoint in --out-dir {out_dir} (see the warnings), "
            f"yet it holds {earlier[0].name}: move the unusable files away, or choose another "
            "--out-dir"
        )
    if earlier and not continues:
        raise UserError(
            f"--out-dir {out_dir} already holds {earlier[0].name} of an earlier run: continue "
            "it with --resume auto, or choose another --out-dir"
        )


def _data_root(config: Config, env: DistEnv) -> Path | None:
    if config.dummy:
        return None
    if config.data is None:
        return ensure_builtin(log=env.is_main)
    root = Path(config.data)
    if not root.is_dir():
        raise UserError(
            f"DATA: {root} is not a directory (expected an ImageFolder root with train/ and val/)"
        )
    return root


def _evaluate_only(run: trainer.Run, state: TrainState) -> TrainState:
    criterion = torch.nn.CrossEntropyLoss()
    val = trainer.evaluate(run.model, run.data.val_loader, run.env, criterion, run.precision)
    run.log.write({"split": "val", "epoch": state.epoch, **val})
    if run.env.is_main:
        print(
            f"val: loss {val['loss']:.4f} acc1 {val['acc1']:.2f} acc5 {val['acc5']:.2f} "
            f"({val['samples']} images)",
            flush=True,
        )
    return state
