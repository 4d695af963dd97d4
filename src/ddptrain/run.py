"""Composition root: builds every object of a run in order and always tears down."""

import json
import os
import random
import secrets
from pathlib import Path

import numpy as np
import torch

from ddptrain import checkpoint, data, distributed, models, optim, parallelize, synth, trainer
from ddptrain.checkpoint import TrainState
from ddptrain.config import Config
from ddptrain.distributed import DistEnv, SpawnSlot
from ddptrain.errors import UserError
from ddptrain.metrics import MetricsLog


def _seed_everything(seed: int, env: DistEnv) -> None:
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # needed by deterministic cuBLAS
    random.seed(seed + env.rank)
    np.random.seed((seed + env.rank) % 2**32)
    torch.manual_seed(seed + env.rank)
    # warn_only: a model whose op has no deterministic kernel still trains, with a warning.
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False


def _data_root(config: Config, env: DistEnv) -> Path | None:
    if config.dummy:
        return None
    if config.data is None:
        return synth.ensure_builtin(log=env.is_main)
    root = Path(config.data)
    if not root.is_dir():
        raise UserError(
            f"DATA: {root} is not a directory (expected an ImageFolder root with train/ and val/)"
        )
    return root


def _write_config(out_dir: Path, config: Config, env: DistEnv, seed: int) -> None:
    resolved = {
        **config.to_dict(),
        "resolved": {
            "world_size": env.world_size,
            "per_rank_batch": config.batch_size // env.world_size,
            "device": str(env.device),
            "data_seed": seed,
        },
    }
    checkpoint.atomic_write(out_dir / "config.json", json.dumps(resolved, indent=2).encode())


def train(config: Config, slot: SpawnSlot | None = None) -> TrainState:
    """Runs the configured job on this process. Importable: any launcher can call it."""
    env = distributed.init(config, slot)
    try:
        return _train(config, env)
    finally:
        distributed.teardown()


def _train(config: Config, env: DistEnv) -> TrainState:
    config.check_batch_divides(env.world_size)
    # One data seed for all ranks: without --seed, rank 0 draws it.
    seed = (
        config.seed
        if config.seed is not None
        else distributed.broadcast_int(secrets.randbits(62), env)
    )
    if config.seed is not None:
        _seed_everything(config.seed, env)
    out_dir = Path(config.out_dir)
    loaders = data.build(config, env, _data_root(config, env), seed)
    model = models.build(config.arch, loaders.num_classes, config.pretrained, env)
    optimizer, scheduler = optim.build(model, config)
    state = _resume_or_start(
        config, env, out_dir, model, optimizer, scheduler, loaders.class_to_idx
    )
    model = parallelize.wrap(model, env, gpu_pinned=config.gpu is not None)
    meta = {
        "arch": config.arch,
        "num_classes": loaders.num_classes,
        "class_to_idx": loaders.class_to_idx,
        "config": config.to_dict(),
    }
    if env.is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
    log = MetricsLog(out_dir, enabled=env.is_main)
    run = trainer.Run(config, env, loaders, model, optimizer, scheduler, meta, log, seed)
    if config.evaluate:
        return _evaluate_only(run, state)
    if env.is_main:
        _write_config(out_dir, config, env, seed)
        print(
            f"training {config.arch} on {loaders.num_classes} classes, {env.world_size} rank(s) "
            f"on {env.device.type}, global batch {config.batch_size}, "
            f"epochs {state.epoch}->{config.epochs}",
            flush=True,
        )
    return trainer.fit(run, state)


def _resume_or_start(config, env, out_dir, model, optimizer, scheduler, class_to_idx) -> TrainState:
    path = checkpoint.resolve(config.resume, out_dir)
    if path is None:
        if config.resume == "auto" and env.is_main:
            print(f"--resume auto: no checkpoint in {out_dir}, starting fresh", flush=True)
        if config.evaluate and not config.pretrained:
            raise UserError(f"--evaluate: no checkpoint to evaluate in {out_dir}")
        optim.fast_forward(scheduler, config.start_epoch)
        return TrainState(epoch=config.start_epoch)
    saved = checkpoint.load(path)
    checkpoint.check_compatible(saved, path, config.arch, class_to_idx)
    state = checkpoint.restore(saved, model, optimizer, scheduler)
    if env.is_main:
        print(
            f"resumed from {path} (epoch {state.epoch}, best acc1 {state.best_acc1:.2f})",
            flush=True,
        )
    return state


def _evaluate_only(run: trainer.Run, state: TrainState) -> TrainState:
    val = trainer.evaluate(run.model, run.data.val_loader, run.env, torch.nn.CrossEntropyLoss())
    run.log.write({"split": "val", "epoch": state.epoch, **val})
    if run.env.is_main:
        print(
            f"val: loss {val['loss']:.4f} acc1 {val['acc1']:.2f} acc5 {val['acc5']:.2f} "
            f"({val['samples']} images)",
            flush=True,
        )
    return state
