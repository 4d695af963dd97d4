"""Preflight: what can be decided about a run before anything is built, decided once and agreed
by every rank, into one frozen `Resolved` that run.py builds from.

In order: the batch divides over the ranks; the out-dir is this run's alone (a lock); rank 0
picks the data seed and the checkpoint to resume, for all; the images to leave out
(--verify-images, --bad-images skip: a collective); then on every rank what may fail on some
only: the out-dir checked, the checkpoint read and its settings merged under the flags', the
merged settings checked, the data source found. One `agree` ends that part, so that a user
error on any rank ends every rank. The seed is applied once, from the merged settings.
"""

import math
import os
import random
import secrets
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ddptrain.config import Config, inert_flags
from ddptrain.config_layers import Layers, check_batch_divides_early, resumed, settled
from ddptrain.data import decode
from ddptrain.data.check import images_to_leave_out
from ddptrain.data.sources import Source, open_source
from ddptrain.distributed.collectives import agree, from_rank0
from ddptrain.distributed.env import DistEnv
from ddptrain.errors import UserError
from ddptrain.model.build import file_preprocessing
from ddptrain.model.providers import provider
from ddptrain.parallel.parallelize import will_shard
from ddptrain.report.progress import counting, say
from ddptrain.report.records import require_tensorboard
from ddptrain.report.reporter import warn
from ddptrain.report.trackers import require as require_tracker
from ddptrain.state.checkpointer import TrainState
from ddptrain.state.lock import lock_out_dir
from ddptrain.state.resume import (
    check_out_dir,
    check_position,
    check_same_leave_out,
    find_resume,
    kept_seed,
    load_resumed,
    saved_data,
)


@dataclass(frozen=True)
class Resolved:
    config: Config  # the checkpoint's settings under --config and the flags, all checked
    out_dir: Path
    source: Source  # where the images come from (data/sources.py)
    seed: int  # orders and augments the data, the same on every rank
    resume: Path | None  # the checkpoint this run continues or evaluates
    saved: dict | None  # its contents
    leave_out: frozenset[str]  # files of DATA that --bad-images skip leaves out
    warnings: tuple[str, ...]  # for rank 0 to say once the run reports
    notes: tuple[str, ...]

    def start(self, steps_per_epoch: int) -> TrainState:
        """Where training starts: the checkpoint's position, else after the epochs
        --start-epoch says are done, and their steps (checkpoint numbers, the schedule, the
        EMA's warm-up)."""
        if self.saved is not None:
            return TrainState.from_checkpoint(self.saved)
        epoch = self.config.checkpoint.start_epoch
        return TrainState(epoch=epoch, global_step=epoch * steps_per_epoch)


def resolve(config: Config, layers: Layers, env: DistEnv, locked=lambda: None) -> Resolved:
    """The run `config` asks for, on this rank; `layers`: what each layer of it gave. A
    collective: every rank calls it. `locked()` is called once this run holds its out-dir."""
    check_batch_divides_early(config, layers, env.world_size)
    check_offload_clipping(config, env)
    out_dir = Path(config.checkpoint.out_dir)
    if not config.checkpoint.evaluate:  # one run per out-dir, before anything reads or writes it
        unlocked = agree(env, lambda: lock_out_dir(out_dir) if env.is_main else None)
        if unlocked:  # a file system without locks
            warn(env, unlocked)
    locked()
    seed = from_rank0(env, lambda: _data_seed(config))
    resume = from_rank0(
        env,
        lambda: find_resume(
            config.checkpoint.resume, out_dir, config.checkpoint.evaluate, lambda w: warn(env, w)
        ),
    )
    # --verify-images, --bad-images skip: of DATA as given or as the resumed run's
    data = config.data.root
    if data is None and resume is not None and config.data.checks_images:
        data = from_rank0(env, lambda: saved_data(resume))
    checked = config.replace(data=data)
    leave_out = images_to_leave_out(checked, env, say, counting)
    resolved = agree(
        env, lambda: _resolve_here(config, layers, env, out_dir, seed, resume, leave_out)
    )
    if resolved.config.optim.seed is not None:
        seed_everything(resolved.config.optim.seed, env)
    return resolved


def _resolve_here(
    config: Config,
    layers: Layers,
    env: DistEnv,
    out_dir: Path,
    seed: int,
    resume: Path | None,
    leave_out: frozenset[str],
) -> Resolved:
    """What may fail on some ranks only. No collectives in here."""
    if env.is_main:
        check_out_dir(
            out_dir, resume, config.checkpoint.evaluate, config.checkpoint.resume == "auto"
        )
    saved = None if resume is None else load_resumed(resume)
    if saved is not None:
        seed = int(saved.get("data_seed", seed))
        given, config = config, resumed(config, layers, saved.get("config"))
        if not config.checkpoint.evaluate:  # evaluating another batch or other data is fine
            check_position(saved, config)
            check_same_leave_out(given, config, resume)
        check_offload_clipping(config, env)  # with the checkpoint's settings too
    config = settled(config)
    if saved is None:  # a resumed run has them in its checkpoint's settings
        config = published_preprocessing(config, layers.given)
    config.check_batch_divides(env.world_size)  # -b is the checkpoint's unless given
    decoding = decode.check_device(config.data.decode_device, env)
    if config.report.tensorboard and not config.checkpoint.evaluate:  # eval writes no events
        require_tensorboard()  # on every rank, so that every rank stops when it is missing
    if not config.checkpoint.evaluate:  # eval logs to no tracker
        for name in config.report.log_to:
            require_tracker(name)  # on every rank, as tensorboard
    flags = layers.on_command_line
    kept = None if saved is None or config.checkpoint.evaluate else kept_seed(config, saved, flags)
    warnings = [line for line in [*inert_flags(config, flags), kept] if line]
    if saved is not None:
        done = TrainState.from_checkpoint(saved)
        notes = [
            f"resumed from {resume} (epoch {done.epoch}, step {done.epoch_step} of the next, "
            f"best acc1 {done.best_acc1:.2f})"
        ]
    elif config.checkpoint.evaluate and not config.model.pretrained:
        raise UserError(f"--evaluate: no checkpoint to evaluate in {out_dir}")
    elif config.checkpoint.resume == "auto":
        notes = [f"--resume auto: no checkpoint in {out_dir}, starting fresh"]
    else:
        notes = []
    if decoding:
        notes.append(decoding)
    return Resolved(
        config=config,
        out_dir=out_dir,
        source=open_source(config, log=say if env.is_main else None, warn=say),
        seed=seed,
        resume=resume,
        saved=saved,
        leave_out=leave_out,
        warnings=tuple(warnings),
        notes=tuple(notes),
    )


def published_preprocessing(config: Config, given: frozenset[str]) -> Config:
    """--pretrained with a timm model: the input its weights were trained with, for each setting
    that no flag or --config file gives (`given`). The published weights' (size, interpolation,
    mean, std, and the val resize of their crop fraction) for --pretrained alone or a file of
    timm's own; a ddptrain checkpoint's or export's own interpolation, mean and std."""
    maker, pretrained = provider(config.model.arch), config.model.pretrained
    if not pretrained or maker.library != "timm":
        return config
    theirs = file_preprocessing(Path(pretrained)) if isinstance(pretrained, str) else None
    if theirs is None:
        theirs = maker.preprocessing(config.model.arch)
    crop_pct = theirs.pop("crop_pct", None)
    config = config.replace(**{key: v for key, v in theirs.items() if key not in given})
    if crop_pct and "val_resize" not in given:
        # timm's own rounding of the resize (timm.data.transforms_factory)
        config = config.replace(val_resize=math.floor(config.data.eval_crop / crop_pct))
    return config


def check_offload_clipping(config: Config, env: DistEnv) -> None:
    """torch 2.14's clip_grad_norm_ sums the norms of the gradients' shards, in host memory
    under --fsdp-offload, over the device's process group: NCCL has no CPU backend, so every
    rank would fail at the first step ("No backend type associated with device type cpu",
    pytorch/pytorch#148532). Refused before anything starts. On the CPU the group is gloo's."""
    offloaded = config.parallel.fsdp_offload and will_shard(env, config.parallel.strategy)
    if offloaded and config.optim.clip_grad_norm is not None and env.device.type != "cpu":
        raise UserError(
            f"--clip-grad-norm does not run with --fsdp-offload on {env.device.type}: torch "
            "sums the offloaded gradients' norms over the device's process group, which takes "
            "no host-memory tensors; drop one of the two"
        )


def _data_seed(config: Config) -> int:
    """--seed, or a fresh random one."""
    return config.optim.seed if config.optim.seed is not None else secrets.randbits(62)


def seed_everything(seed: int, env: DistEnv) -> None:
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # needed by deterministic cuBLAS
    random.seed(seed + env.rank)
    np.random.seed((seed + env.rank) % 2**32)
    torch.manual_seed(seed + env.rank)
    # warn_only: a model whose op has no deterministic kernel still trains, with a warning.
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False
