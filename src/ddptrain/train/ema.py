"""An exponential moving average of the weights and buffers (--model-ema), on every rank.

torch's `get_ema_multi_avg_fn` does the averaging, of the buffers too, so BatchNorm statistics
follow the averaged weights, as in torchvision's references. Each rank averages what it holds:
under ddp a whole copy (DDP keeps the weights equal on every rank), under fsdp its shards, into
a twin of the model sharded alike, which is evaluated and saved as the model is. Not torch's
`AveragedModel`: it deep-copies the model, which FSDP2 refuses, and averages the parameters and
buffers in one call, which fails when the parameters are DTensors and the buffers plain tensors.
Evaluation and checkpoints use rank 0's averaged buffers, as they use rank 0's own.

What the decay means: --model-ema-decay D is the decay per optimizer step. -b is the global
batch, so an optimizer step consumes the same samples at any world size and D averages over the
same stretch of training (about 1 / (1 - D) steps) on 1 rank or 64. With --model-ema-steps K,
the average is updated every K steps with decay D^K: K trades cost for granularity, not the
horizon. torchvision's references instead scale (1 - D) by per-GPU batch x GPUs x K / epochs,
which makes D a share of the whole run; their D = 0.99998 with 1024 x 32 / 600 is D = 0.999966
per step here (recipes/resnet50-torchvision.toml).

During the LR warmup (warmup_steps), the average restarts at every update, so it holds the
current weights, as torchvision's references reset theirs in the warmup epochs: an average of
the random initial weights would take 1 / (1 - D) steps to forget.

The decay warms up (build_ema sets ramp): the n-th update after the average (re)started (last at
the LR warmup's end) takes min(D^K, (1 + n) / (10 + n)), TensorFlow's ExponentialMovingAverage
with num_updates. The average then holds about the last tenth of its updates, for any K, until that
outgrows the horizon (after 9 / (1 - D) steps); a fixed D would keep a run shorter than its
horizon tied to the weights it began from, long left behind. The ramp counts `updates` alone,
which checkpoints hold: a resumed run and any world size take the same decays.
"""

import copy
from collections import defaultdict

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.swa_utils import get_ema_multi_avg_fn

from ddptrain.config import OptimSettings
from ddptrain.distributed.env import DistEnv
from ddptrain.parallel.parallelize import is_sharded, reshard_gathered
from ddptrain.state import sharded
from ddptrain.state.checkpointer import ModelState


class ModelEma:
    def __init__(
        self,
        model: nn.Module,
        env: DistEnv,
        decay: float,
        every: int = 1,
        warmup_steps: int = 0,
        averaged: nn.Module | None = None,
        ramp: bool = False,
    ):
        """model: the trained model, unwrapped (placed; under fsdp, sharded). averaged: the
        module that holds the average, shaped as model: by default a deep copy of it; under
        fsdp a twin sharded alike (fsdp.shard_twin), into which the model's shards are copied.
        ramp: warm the decay up (see above); without it every update takes D^K, as torch's
        AveragedModel does."""
        assert every >= 1
        self.env, self.every, self.warmup_steps = env, every, warmup_steps
        self.decay, self.ramp = decay**every, ramp
        if averaged is None:
            averaged = copy.deepcopy(model)
        else:
            _copy(_held(model), _held(averaged))
        self.module = averaged
        self.module.eval()  # never trained; evaluate() sets the mode anyway
        self.updates = 0
        self.weights = ModelState(self.module, env, is_sharded(self.module))

    def current_decay(self) -> float:
        """The decay of the next update, after `updates` of them (the first copies)."""
        if self.updates == 0:
            return 0.0
        if not self.ramp:
            return self.decay
        return min(self.decay, (1 + self.updates) / (10 + self.updates))

    def start_from(self, model: nn.Module) -> None:
        """The average begins anew at the model's weights as they are now (restored from a
        checkpoint that holds no average); its first update copies them again."""
        _copy(_held(model), _held(self.module))
        self.updates = 0

    @torch.no_grad()
    def update(self, model: nn.Module, step: int) -> None:
        """After optimizer step number `step` (counted from 1 over the whole run, like the
        checkpoint's global_step), with the unwrapped model that step updated. Every rank."""
        if step % self.every:
            return
        if step <= self.warmup_steps:
            self.updates = 0  # this update copies the weights
        mine, theirs = _held(self.module), _held(model)
        if self.updates == 0:
            _copy(theirs, mine)
        else:
            # By device and dtype, as AveragedModel groups them: the average lerps floats and
            # takes another formula for integers (BatchNorm's batch counts), chosen by the
            # first tensor of a call.
            average = get_ema_multi_avg_fn(self.current_decay())
            groups = defaultdict(lambda: ([], []))
            for averaged, current in zip(mine, theirs, strict=True):
                group = groups[averaged.device, averaged.dtype]
                group[0].append(averaged)
                group[1].append(current)
            for averaged, current in groups.values():
                average(averaged, current, None)
        self.updates += 1

    def state_dict(self) -> dict:
        """{"model": the averaged model's plain state dict (keys as the model's own, whole, on
        rank 0), "updates": how many updates it has had}: loadable with weights_only=True. A
        collective."""
        return {"model": self.weights.state_dict(), "updates": self.updates}

    def local_state_dict(self) -> dict:
        """As this rank holds it, for a sharded checkpoint: its shards under fsdp."""
        return {"model": self.weights.local_state_dict(), "updates": self.updates}

    def load_state_dict(self, state) -> None:
        """A state_dict() (rank 0's is broadcast under fsdp), or a sharded checkpoint's part
        read into this rank's own layout. A collective."""
        if isinstance(state, sharded.Stored):
            own = self.local_state_dict()
            state.load_into(own)
            self.weights.set_local(own["model"])
        else:
            own = state
            self.weights.load_state_dict(state["model"])
        self.updates = int(own["updates"])


@torch.no_grad()
def _copy(sources: list[torch.Tensor], destinations: list[torch.Tensor]) -> None:
    for source, destination in zip(sources, destinations, strict=True):
        destination.copy_(source)


def _held(model: nn.Module) -> list[torch.Tensor]:
    """The parameters and buffers as this rank holds them: a DTensor's local shard.

    A gathered module's parameters are the whole tensors, so any group still gathered (as FSDP
    leaves some after a forward without backward) is resharded first, and the next forward
    gathers the new average."""
    reshard_gathered(model)
    return [
        t.to_local() if isinstance(t, DTensor) else t
        for t in (*model.parameters(), *model.buffers())
    ]


def build_ema(
    model: nn.Module,
    config: OptimSettings,
    env: DistEnv,
    steps_per_epoch: int,
    averaged: nn.Module | None = None,
) -> ModelEma | None:
    """The run's EMA with --model-ema, else None. model: the unwrapped, placed model;
    averaged: under fsdp, its twin sharded alike."""
    if not config.model_ema:
        return None
    warmup_steps = round(config.lr_warmup_epochs * steps_per_epoch)
    return ModelEma(
        model,
        env,
        config.model_ema_decay,
        config.model_ema_steps,
        warmup_steps,
        averaged,
        ramp=True,
    )
