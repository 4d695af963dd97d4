"""An exponential moving average of the weights and buffers (--model-ema), on every rank.

torch's `AveragedModel` with `get_ema_multi_avg_fn` does the averaging; buffers are averaged
too (use_buffers=True), so BatchNorm statistics follow the averaged weights, as in
torchvision's references. Every rank keeps the same average of the same weights (DDP keeps
them equal), so the EMA model can be evaluated over each rank's val shard like the raw one.

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
"""

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from ddptrain.config import Config


class ModelEma:
    def __init__(self, model: nn.Module, decay: float, every: int = 1, warmup_steps: int = 0):
        """model: the unwrapped model, on its device and in its memory format (copied)."""
        assert every >= 1
        self.every, self.warmup_steps = every, warmup_steps
        self.averaged = AveragedModel(
            model, multi_avg_fn=get_ema_multi_avg_fn(decay**every), use_buffers=True
        )
        self.averaged.eval()  # never trained; evaluate() sets the mode anyway

    @property
    def module(self) -> nn.Module:
        """The averaged model: evaluate it, or save its state dict as a model's."""
        return self.averaged.module

    @torch.no_grad()
    def update(self, model: nn.Module, step: int) -> None:
        """After optimizer step number `step` (counted from 1 over the whole run, like the
        checkpoint's global_step), with the unwrapped model that step updated. Every rank.

        On CUDA, AveragedModel copies its update counter to the device at each update, a host
        synchronisation every --model-ema-steps steps."""
        if step % self.every:
            return
        if step <= self.warmup_steps:
            self.averaged.n_averaged.zero_()  # the next update copies the weights
        self.averaged.update_parameters(model)

    def state_dict(self) -> dict:
        """{"model": the averaged model's plain state dict (keys as the model's own, no wrapper
        prefix), "updates": how many updates it has had}: loadable with weights_only=True."""
        return {
            "model": {k: v.detach() for k, v in self.module.state_dict().items()},
            "updates": int(self.averaged.n_averaged),
        }

    def load_state_dict(self, state: dict) -> None:
        self.module.load_state_dict(state["model"], strict=True)
        self.averaged.n_averaged.fill_(int(state["updates"]))


def build_ema(model: nn.Module, config: Config, steps_per_epoch: int) -> ModelEma | None:
    """The run's EMA with --model-ema, else None. model: the unwrapped, placed model."""
    if not config.model_ema:
        return None
    warmup_steps = round(config.lr_warmup_epochs * steps_per_epoch)
    return ModelEma(model, config.model_ema_decay, config.model_ema_steps, warmup_steps)
