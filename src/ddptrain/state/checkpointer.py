"""The Checkpointer: a run's state, gathered from its Stateful parts and restored into them.

Called on EVERY rank. Each part (model, optimizer, scheduler, gradient scaler, EMA, ...) gives its
state_dict on every rank, because under fsdp the full tensors are gathered to rank 0 by a
collective; under ddp the same calls are local and give rank 0 its own copy. Rank 0 writes the
single file (state/files.py: atomic, numbered, retained); the other ranks learn whether it
succeeded, so a failed write ends every rank. In the sharded format (state/sharded.py) the model,
optimizer and EMA stay as the ranks hold them and each rank writes its own shards.

The file holds (DESIGN.md): `model` (plain state dict, no wrapper prefixes, CPU tensors),
`optimizer` (keyed by parameter name), `scheduler`, the run counters of `TrainState` (`epoch`,
`global_step`, `best_acc1`, `stale_epochs` for --early-stop, and to continue mid-epoch
`epoch_step`, `train_sums`, `epoch_lr`), the run's metadata (`arch`, `num_classes`,
`class_to_idx`, `config`, `data_seed`) and `format_version`.
Model-side randomness needs no saved state: it is derived from the seed, epoch, step and rank at
every step, as augmentation is per sample.
"""

import contextlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map_only

from ddptrain.distributed.collectives import agree, broadcast_buffers
from ddptrain.distributed.env import DistEnv
from ddptrain.errors import UserError
from ddptrain.state import files, sharded
from ddptrain.state.files import FORMAT_VERSION

# Full tensors, on the CPU, on rank 0 only (the other ranks get empty dicts).
_GATHER = StateDictOptions(full_state_dict=True, cpu_offload=True)


@dataclass
class TrainState:
    """The run's counters: where training is, and the best result so far."""

    epoch: int = 0  # epochs completed
    global_step: int = 0
    best_acc1: float = 0.0
    best_model: str = "model"  # which of "model" and "model_ema" model_best.pt was saved for
    stale_epochs: int = 0  # epochs in a row since best_acc1 last rose (--early-stop)
    epoch_step: int = 0  # steps done in the epoch after `epoch`
    train_sums: torch.Tensor | None = None  # that epoch's running train sums, all ranks
    epoch_lr: float | None = None  # the learning rate that epoch began with, for its record

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "global_step": self.global_step,
            "best_acc1": self.best_acc1,
            "best_model": self.best_model,
            "stale_epochs": self.stale_epochs,
            "epoch_step": self.epoch_step,
            "train_sums": self.train_sums,
            "epoch_lr": self.epoch_lr,
        }

    @classmethod
    def from_checkpoint(cls, checkpoint: dict) -> "TrainState":
        return cls(
            epoch=int(checkpoint.get("epoch", 0)),
            global_step=int(checkpoint.get("global_step", 0)),
            best_acc1=float(checkpoint.get("best_acc1", 0.0)),
            best_model=str(checkpoint.get("best_model", "model")),
            # 0 in a checkpoint from before --early-stop: its count starts there
            stale_epochs=int(checkpoint.get("stale_epochs", 0)),
            epoch_step=int(checkpoint.get("epoch_step", 0)),
            train_sums=checkpoint.get("train_sums"),
            epoch_lr=checkpoint.get("epoch_lr"),
        )


class ModelState(Stateful):
    """The weights of a plain, DDP or FSDP model as one plain state dict."""

    def __init__(self, model: nn.Module, env: DistEnv, sharded: bool):
        self.model, self.env, self.sharded = model, env, sharded

    def state_dict(self) -> dict:
        """Whole, on rank 0. A collective, as every method here."""
        self._agree_buffers()
        return get_model_state_dict(self.model, options=_GATHER)

    def local_state_dict(self) -> dict:
        """As this rank holds it: its shards under fsdp (what a sharded checkpoint writes)."""
        self._agree_buffers()
        return get_model_state_dict(self.model)

    def _agree_buffers(self) -> None:
        # Rank 0's BatchNorm statistics on every rank, as saved: under fsdp nothing else keeps
        # them equal, and the run goes on from what the checkpoint holds.
        broadcast_buffers(self.model, self.env)

    def load_state_dict(self, state) -> None:
        """A plain state dict (rank 0's is broadcast under fsdp), or a sharded checkpoint's part
        read into this rank's own layout."""
        if isinstance(state, sharded.Stored):
            own = self.local_state_dict()
            state.load_into(own)
            self.set_local(own)
        else:
            self._set(self._mine(state), _loading(self.sharded))

    def set_local(self, state: dict) -> None:
        """Loads a local_state_dict() (this rank's shards under fsdp)."""
        self._set(state, StateDictOptions())

    def _set(self, state: dict, options: StateDictOptions) -> None:
        full = options.full_state_dict or options.broadcast_from_rank0
        with _buffers_beside_parameters(self.model) if full else contextlib.nullcontext():
            set_model_state_dict(self.model, state, options=options)

    def _mine(self, state: dict) -> dict:
        """What this rank passes in: a copy (the call consumes the dict it is given); under fsdp
        only rank 0's, which the load broadcasts to the shards, every tensor contiguous.
        broadcast_from_rank0 (torch 2.14, on any backend) sends a tensor's memory as it lies,
        and the other ranks receive it into contiguous tensors: the channels_last weights (and
        momentum) of a ddp checkpoint would arrive there scrambled."""
        if not self.sharded:
            return dict(state)
        if not self.env.is_main:
            return {}
        return tree_map_only(torch.Tensor, torch.Tensor.contiguous, state)


class OptimizerState(ModelState):
    """The optimizer's state keyed by parameter name, as one plain state dict."""

    def __init__(self, model: nn.Module, optimizer, env: DistEnv, sharded: bool):
        super().__init__(model, env, sharded)
        self.optimizer = optimizer

    def state_dict(self) -> dict:
        with _gradients_set_aside(self.model):
            return get_optimizer_state_dict(self.model, self.optimizer, options=_GATHER)

    def local_state_dict(self) -> dict:
        # A fresh optimizer's state is created here (a step with zero gradients and lr 0), so
        # that a sharded load has tensors to fill.
        with _gradients_set_aside(self.model):
            return get_optimizer_state_dict(self.model, self.optimizer)

    def _set(self, state: dict, options: StateDictOptions) -> None:
        with _gradients_set_aside(self.model):
            set_optimizer_state_dict(self.model, self.optimizer, state, options=options)


@contextlib.contextmanager
def _gradients_set_aside(model: nn.Module) -> Iterator[None]:
    """No gradients while inside, the same ones after. torch's optimizer state dict functions
    make a fresh optimizer's state to load into (a step with zero gradients and lr 0) only when
    no parameter has a gradient; under ddp the gradients are zeros in DDP's buckets before the
    first step (parallel.parallelize.lay_out_buckets)."""
    params = [p for p in model.parameters() if p.grad is not None]
    kept = [p.grad for p in params]
    for param in params:
        param.grad = None
    try:
        yield
    finally:
        for param, grad in zip(params, kept, strict=True):
            param.grad = grad


@contextlib.contextmanager
def _buffers_beside_parameters(model: nn.Module) -> Iterator[None]:
    """Buffers on the parameters' device while inside. torch's full state dict load refuses a
    model on two devices ("Multiple devices found"), as under --fsdp-offload on a GPU: shards in
    host memory, buffers on the GPU. The load then broadcasts on the process group's device.
    (A sharded load makes no such check.)"""
    homes = {p.device for p in model.parameters()}
    moved = []
    for module in model.modules() if len(homes) == 1 else ():
        for name, buffer in module.named_buffers(recurse=False):
            if buffer.device not in homes:
                moved.append((module, name, buffer.device))
                setattr(module, name, buffer.to(*homes))
    try:
        yield
    finally:
        for module, name, device in moved:
            setattr(module, name, getattr(module, name).to(device))


def training_parts(
    model: nn.Module, optimizer, scheduler, env: DistEnv, scaler=None, sharded: bool = False
) -> dict[str, Stateful]:
    """The Stateful parts of a training run, by their names in the file. `model` is the
    unwrapped module; `sharded`: it is an FSDP module. `scaler`: fp16's GradScaler, whose loss
    scale a resumed run continues from."""
    parts = {
        "model": ModelState(model, env, sharded),
        "optimizer": OptimizerState(model, optimizer, env, sharded),
        "scheduler": scheduler,
    }
    if scaler is not None:
        parts["scaler"] = scaler
    return parts


def _loading(sharded: bool) -> StateDictOptions:
    # Separate model and optimizer loads: the combined set_state_dict with empty dicts on the
    # other ranks deadlocks under fsdp (torch 2.14).
    return StateDictOptions(full_state_dict=True, broadcast_from_rank0=sharded)


class Checkpointer:
    """Saves and restores the run's parts; every method is called on every rank."""

    def __init__(
        self,
        env: DistEnv,
        out_dir: Path,
        parts: dict[str, Stateful],
        meta: dict,
        record: dict,
        keep_last: int,
        sharded_format: bool = False,
        mark: Callable[[str], None] = lambda stage: None,
        every: int = 0,
    ):
        """every: also save mid-epoch, every this many optimizer steps (0: at epoch ends only)."""
        self.env, self.out_dir = env, out_dir
        self.every = every
        self.parts, self.meta, self.record, self.keep_last = parts, meta, record, keep_last
        self.sharded_format = sharded_format
        # Each stage of a save as it begins (Phases.within_step): a rank stuck writing is named
        # by the ranks waiting for it.
        self.mark = mark

    def due(self, state: TrainState, steps: int) -> bool:
        """Whether to save mid-epoch after this step of an epoch of `steps`; not at its last
        step, as the epoch's end has its own checkpoint, after evaluation."""
        every = self.every
        return bool(every) and state.global_step % every == 0 and state.epoch_step < steps

    def gather(self, state: TrainState) -> dict:
        """The checkpoint of the run at `state`, whole on rank 0 (empty parts elsewhere). A
        collective."""
        return self._contents({name: part.state_dict() for name, part in self.parts.items()}, state)

    def _contents(self, states: dict, state: TrainState) -> dict:
        """What a checkpoint holds besides (or with) the parts' states."""
        return {"format_version": FORMAT_VERSION, **states, **state.state_dict(), **self.meta}

    def save(self, state: TrainState, is_best: bool = False) -> None:
        """Writes checkpoint-<step>.pt (and model_best.pt when is_best) from rank 0, with
        config.json beside it; the sharded format writes checkpoint-<step>.dcp from every
        rank. A collective: a failed write ends every rank."""
        if self.sharded_format:
            return self._save_sharded(state, is_best)
        checkpoint = self.gather(state)

        def write() -> None:
            self.mark("checkpoint: writing")
            if self.env.is_main:
                _check_finite(checkpoint, state)
                files.save(self.out_dir, checkpoint, is_best, self.keep_last)
                _drop_other_latest(self.out_dir, sharded.LATEST)
                self._write_config()
            self.mark("checkpoint: written")

        agree(self.env, write, doing="writing a checkpoint")

    def _save_sharded(self, state: TrainState, is_best: bool) -> None:
        tensors = {
            name: self.parts[name].local_state_dict()
            for name in sharded.SHARDED_PARTS
            if name in self.parts
        }
        rest = self._contents(
            {n: p.state_dict() for n, p in self.parts.items() if n not in tensors}, state
        )

        # model_best.dcp holds the weights that scored best (files.best_copy): when they are the
        # EMA's, it is written apart, with the EMA's shards as its model.
        best_apart = is_best and state.best_model == "model_ema"

        def prepare() -> None:
            _check_finite(_local_weights(tensors), state)  # each rank its shards
            if self.env.is_main:
                sharded.prepare(self.out_dir, state.global_step, best_apart)

        agree(self.env, prepare, doing="writing a checkpoint")
        self.mark("checkpoint: writing")
        sharded.write_shards(tensors, sharded.temp_folder(self.out_dir, state.global_step))
        if best_apart:
            ema = {**tensors, "model": tensors["model_ema"]["model"]}
            sharded.write_shards(ema, sharded.best_temp_folder(self.out_dir))

        def commit() -> None:
            if self.env.is_main:
                sharded.commit(self.out_dir, rest, is_best, self.keep_last, best_apart)
                _drop_other_latest(self.out_dir, files.LATEST)
                self._write_config()
            self.mark("checkpoint: written")

        agree(self.env, commit, doing="writing a checkpoint")

    def _write_config(self) -> None:
        # Written with the checkpoint, not before: a run that fails early changes nothing.
        config_json = json.dumps(self.record, indent=2).encode()
        files.atomic_write(self.out_dir / "config.json", config_json)

    def restore(self, checkpoint: dict, skip: set[str] = frozenset()) -> TrainState:
        """Loads every part the checkpoint holds but those in `skip` (check_fits has passed on
        every rank first: a mismatch found inside the collective loads would leave the other
        ranks waiting)."""
        for name, part in self.parts.items():
            if name in checkpoint and name not in skip:
                part.load_state_dict(checkpoint[name])
        return TrainState.from_checkpoint(checkpoint)


def _drop_other_latest(out_dir: Path, other: str) -> None:
    """After a save, the other format's latest link (a run resumed with another
    --checkpoint-format) names an older checkpoint: `eval --resume out/checkpoint.pt` would
    take its weights, and a hard link would keep a retired checkpoint's space."""
    (out_dir / other).unlink(missing_ok=True)


def _local_weights(tensors: dict) -> dict:
    """The model's and the EMA's weights in this rank's own parts, as weights_finite reads a
    checkpoint."""
    weights = {"model": _local(tensors["model"])}
    if "model_ema" in tensors:
        weights["model_ema"] = {"model": _local(tensors["model_ema"]["model"])}
    return weights


def _local(state: dict) -> dict:
    """This rank's own part of each tensor (a DTensor's shard), to check without collectives."""
    return {k: v.to_local() if isinstance(v, DTensor) else v for k, v in state.items()}


def _check_finite(checkpoint: dict, state: TrainState) -> None:
    """Weights with a NaN or inf are never written (nor chosen by --resume auto)."""
    if not files.weights_finite(checkpoint):
        raise UserError(
            f"the weights are not finite at global step {state.global_step}: not saved (the "
            "previous checkpoint stays the newest); lower --lr or set --clip-grad-norm "
            "(--nonfinite skip drops the steps whose gradients are not finite, not an update "
            "that overflows)"
        )


def check_compatible(checkpoint: dict, path: Path, arch: str, class_to_idx: dict) -> None:
    if checkpoint.get("arch", arch) != arch:
        raise UserError(f"--resume: {path} holds a {checkpoint['arch']} model, not --arch {arch}")
    saved = checkpoint.get("class_to_idx")
    if saved is not None and saved != class_to_idx:
        only_saved = sorted(set(saved) - set(class_to_idx))
        only_data = sorted(set(class_to_idx) - set(saved))
        detail = (
            f"only in the checkpoint: {_some(only_saved)}; only in the data: {_some(only_data)}"
            if only_saved or only_data
            else "same names, other order"
        )
        raise UserError(f"--resume: {path} was trained on other classes than the data ({detail})")


def _some(names: list[str], shown: int = 5) -> str:
    """The first few names, and how many more: one line, for a thousand classes too."""
    more = f", and {len(names) - shown} more" if len(names) > shown else ""
    return (", ".join(map(repr, names[:shown])) or "none") + more


def check_fits(checkpoint: dict, path: Path, model: nn.Module) -> None:
    """The saved weights and optimizer state match the (unwrapped) model's names and shapes."""
    own = model.state_dict()
    saved = _shapes(checkpoint["model"])
    problems = [f"missing {k}" for k in own if k not in saved]
    problems += [f"unexpected {k}" for k in saved if k not in own]
    problems += [
        f"{k} is {saved[k]} in the checkpoint, {tuple(v.shape)} in the model"
        for k, v in own.items()
        if saved.get(k) is not None and saved[k] != tuple(v.shape)
    ]
    parameters = dict(model.named_parameters())
    problems += [
        f"optimizer state for unknown {k}"
        for k in _optimizer_state_names(checkpoint.get("optimizer", {}), parameters)
        if k not in parameters
    ]
    if problems:
        shown = "; ".join(problems[:3]) + (
            f"; and {len(problems) - 3} more" if problems[3:] else ""
        )
        raise UserError(f"--resume: {path} does not fit this model: {shown}")


def _shapes(model_state) -> dict[str, tuple[int, ...] | None]:
    """Each saved key's shape (None for a non-tensor entry), from a state dict or on disk."""
    if isinstance(model_state, sharded.Stored):
        return model_state.shapes()
    return {
        k: tuple(v.shape) if isinstance(v, torch.Tensor) else None for k, v in model_state.items()
    }


def _optimizer_state_names(optimizer_state, parameters: dict) -> set[str]:
    """The parameter names the saved optimizer state is for."""
    if not isinstance(optimizer_state, sharded.Stored):
        return set(optimizer_state.get("state", {}))
    # On disk the keys are "state.<parameter name>.<state name>": match the known names first.
    names = set()
    for key in optimizer_state.shapes():
        if key.startswith("state."):
            rest = key.removeprefix("state.")
            known = [p for p in parameters if rest.startswith(f"{p}.")]
            names.add(max(known, key=len) if known else rest.rsplit(".", 1)[0])
    return names
