"""The start-up block rank 0 shows before training, also kept in config.json."""

import torch
import torch.distributed as dist
import torchvision

from ddptrain import __version__
from ddptrain.data.transforms import normalization, val_sizes
from ddptrain.distributed.env import DistEnv


def start_summary(config, env, loaders, precision, parameters, steps_per_epoch, resume) -> dict:
    """Its lines by their labels, in the order shown."""
    nodes = env.world_size // env.local_world_size
    strategy = config.parallel.strategy if env.distributed else "one process (nothing to shard)"
    train = loaders.train_sampler.num_samples if loaders.train_sampler else 0
    batch, accum_steps = config.optim.batch_size, config.optim.accum_steps
    summary = {
        "ddptrain": f"{__version__}, torch {torch.__version__}, torchvision "
        f"{torchvision.__version__}",
        "device": f"{env.device.type}, backend {_backend(env)}",
        "world": f"{env.world_size} rank(s) = {nodes} node(s) x {env.local_world_size}",
        "batch": f"{batch} global, {batch // env.world_size} per rank"
        + (f" in {accum_steps} micro-batches" if accum_steps > 1 else ""),
        "steps/epoch": steps_per_epoch,
        "model": f"{config.model.arch}, {parameters / 1e6:.2f} M parameters",
        "precision": f"amp {precision.amp_choice()}, channels_last {precision.channels_last}, "
        f"compile {precision.compile}",
        "strategy": strategy,
        "data": f"{loaders.num_classes} classes, {train} train / {loaders.num_val} val images",
        "input": _input(config.data),
        "out dir": str(config.checkpoint.out_dir),
        "start": (
            f"resumed from {resume}" if resume else f"fresh, epoch {config.checkpoint.start_epoch}"
        ),
    }
    tuning = _finetuning(config)
    if tuning:
        summary["fine-tuning"] = tuning
    return summary


def _finetuning(config) -> str:
    """What the fine-tuning flags set, if any."""
    optim, model = config.optim, config.model
    parts = []
    if optim.freeze_backbone:
        until = optim.unfreeze_epoch
        parts.append("head only" + (f" for {until} epoch(s), then all" if until else ""))
    if optim.layer_decay is not None:
        parts.append(f"layer decay {optim.layer_decay:g}")
    if optim.head_lr_scale != 1:
        parts.append(f"head LR x{optim.head_lr_scale:g}")
    if model.drop_path:
        parts.append(f"drop path {model.drop_path:g}")
    if model.grad_checkpointing:
        parts.append("activation checkpointing")
    return ", ".join(parts)


def _backend(env: DistEnv) -> str:
    return dist.get_backend() if env.distributed else "none (one process)"


def _input(data) -> str:
    """How images become inputs: crops, interpolation, normalisation (--pretrained with a timm
    model takes them from its weights)."""
    resize, crop = val_sizes(data)
    mean, std = normalization(data)
    return (
        f"{data.image_size} px train crops, val resize {resize} crop {crop}, "
        f"{data.interpolation}, mean {_numbers(mean)}, std {_numbers(std)}"
    )


def _numbers(values) -> str:
    return "(" + ", ".join(f"{v:.4g}" for v in values) + ")"
