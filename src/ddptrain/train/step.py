"""One optimizer step of the training loop: forward, backward, (sync), clip, optimizer step,
schedule, and the checks between them."""

import contextlib
import warnings
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

from ddptrain.errors import UserError
from ddptrain.model.precision import Precision
from ddptrain.parallel.parallelize import (
    forget_dropped_step,
    gradients_in_buckets,
    no_gradient_sync,
)

AUX_WEIGHT = 0.4  # googlenet and inception_v3 auxiliary heads, as torchvision's references

# torch warns "lr_scheduler.step() before optimizer.step()" when the run's first steps were
# dropped (--nonfinite skip): the order is right, the update was withheld. Filtered once here:
# a catch_warnings around each step would reset which warnings were already shown.
warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step", UserWarning)


def gradients_set_to_none(accum_steps: int, in_buckets: bool) -> bool:
    """Whether zero_grad sets the gradients to None, or zeroes them where they are. Accumulating
    into DDP's buckets (`in_buckets`), they are zeroed there: set to None, the backward passes
    in no_sync would make them anew beside the buckets and the step would hold them twice."""
    return not (accum_steps > 1 and in_buckets)


class StepResult(NamedTuple):
    loss: torch.Tensor  # the batch's mean (detached when accumulated; NaN when a gradient was not
    # finite under --nonfinite error)
    output: torch.Tensor  # the logits
    skipped: bool  # the update was dropped, on every rank (--nonfinite skip)


class Step:
    """One optimizer step, read as forward / backward / clip / optimizer step / schedule, each
    a stage of its own so that checks slot in between without touching the others.

    With accum_steps K, the batch is split into K micro-batches: forward and backward each, the
    gradients reduced over the ranks only in the last backward (DDP's buckets, FSDP's
    reduce-scatter), each loss divided by K so the sum is the full batch's mean. No stage
    synchronises the host with the device.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer,
        precision: Precision | None = None,
        criterion=None,
        scheduler=None,
        accum_steps: int = 1,
        clip_grad_norm: float | None = None,
        skip_nonfinite: bool = False,
        mark: Callable[[str], None] | None = None,
    ):
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.mark = mark or (lambda phase: None)  # where the step is, for a stall's error
        self.precision = precision or Precision()
        self.criterion = criterion or nn.CrossEntropyLoss()
        self.accum_steps, self.clip_grad_norm = accum_steps, clip_grad_norm
        self.skip_nonfinite = skip_nonfinite
        self.set_to_none = gradients_set_to_none(accum_steps, gradients_in_buckets(model))

    def forward(self, images: torch.Tensor, target: torch.Tensor):
        """The (device) loss and logits."""
        with self.precision.autocast():
            output = self._model(images)
            if isinstance(output, tuple):  # (logits, *auxiliary logits) in train mode
                output, *aux = output
                aux_loss = sum(self.criterion(a, target) for a in aux)
                return self.criterion(output, target) + AUX_WEIGHT * aux_loss, output
            return self.criterion(output, target), output

    def _model(self, images: torch.Tensor) -> torch.Tensor:
        try:
            return self.model(images)
        except ValueError as err:  # batch norm's, in train mode; every rank meets it alike
            if "more than 1 value per channel" not in str(err):
                raise
            raise UserError(
                f"BatchNorm needs more than one value per channel, and a forward of {len(images)} "
                "image per rank (-b / ranks / --accum-steps) reaches a 1x1 feature map: raise "
                "-b, lower --accum-steps, or raise --image-size"
            ) from None

    def backward(self, loss: torch.Tensor) -> None:
        self.precision.backward(loss / self.accum_steps if self.accum_steps > 1 else loss)

    def finite(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """Whether this rank's losses and gradients (its shards under fsdp) are all finite: a
        flag on the device, so asking costs no host synchronisation. A sum per gradient is NaN
        or inf when one of its elements is (a sum of finite ones overflows only past 3e38), and
        is the cheapest full pass: 8 ms a step for resnet50 on one CPU thread, where an inf-norm
        or isfinite took 80. Under fp16 only the losses count: the scaler's gradients are inf
        whenever its scale overflows, and it skips those steps itself."""
        flags = [torch.isfinite(loss).all() for loss in losses]
        if self.precision.scaler is None:
            grads = [getattr(p.grad, "_local_tensor", p.grad) for p in self.model.parameters()]
            sums = [g.sum() for g in grads if g is not None]
            if sums:  # on the losses' device: under --fsdp-offload gradients are in host memory
                flag = torch.isfinite(torch.stack(sums).sum())
                flags.append(flag.to(flags[0].device, non_blocking=True))
        return torch.stack(flags).all()

    def agreed_finite(self, losses: list[torch.Tensor]) -> bool:
        """`finite`, the same answer on every rank. A host synchronisation (and an all-reduce of
        one number): --nonfinite skip pays it at every step, to decide before the update."""
        finite = self.finite(losses).to(torch.int32).reshape(1)
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            torch.distributed.all_reduce(finite, op=torch.distributed.ReduceOp.MIN)
        return bool(finite)

    def clip(self) -> None:
        """The gradients' total norm over all ranks (equal on every rank: they are reduced)
        clipped to --clip-grad-norm."""
        if self.clip_grad_norm is not None:
            self.precision.unscale(self.optimizer)
            parameters = [p for p in self.model.parameters() if p.grad is not None]
            torch.nn.utils.clip_grad_norm_(parameters, self.clip_grad_norm, foreach=True)

    def optimizer_step(self) -> None:
        self.precision.step(self.optimizer)

    def schedule(self) -> None:
        """Schedules move per optimizer step (train/schedule.py), so warmup is smooth and a run
        resumed mid-epoch continues on the same curve. A step dropped by --nonfinite skip moves
        it too: the schedule counts global steps, as the step numbers of checkpoints do."""
        if self.scheduler is not None:
            self.scheduler.step()

    def __call__(self, images: torch.Tensor, target: torch.Tensor) -> StepResult:
        losses, outputs = [], []
        # A dropped step leaves no trace: the forward in train mode moves BatchNorm's running
        # statistics, which a bad batch makes non-finite, so they go back as they were.
        buffers = [b.detach().clone() for b in self.model.buffers()] if self.skip_nonfinite else []
        chunks = zip(images.chunk(self.accum_steps), target.chunk(self.accum_steps), strict=True)
        for i, (micro_images, micro_target) in enumerate(chunks):
            last = i == self.accum_steps - 1
            with contextlib.nullcontext() if last else no_gradient_sync(self.model):
                self.mark("forward")
                loss, output = self.forward(micro_images, micro_target)
                if i == 0:
                    # The last step's gradients go just before the first backward, as the
                    # classic loop does (what `ddptrain plan` traces); under DDP they are views
                    # into its buckets, which live for the whole run anyway.
                    self.optimizer.zero_grad(set_to_none=self.set_to_none)
                self.mark("backward")  # DDP's all-reduce runs inside it
                self.backward(loss)
            losses.append(loss.detach())
            outputs.append(output)
        loss = losses[0] if self.accum_steps == 1 else torch.stack(losses).mean()
        skipped = False
        if self.skip_nonfinite:
            skipped = not self.agreed_finite(losses)
        else:
            # --nonfinite error: a step whose gradients are not finite reports a NaN loss, so
            # the checks on the loss (train_epoch's, on device) catch it at this very step.
            loss = torch.where(self.finite(losses), loss, float("nan"))
        if skipped:  # on every rank
            self.optimizer.zero_grad(set_to_none=self.set_to_none)
            for buffer, kept in zip(self.model.buffers(), buffers, strict=True):
                buffer.copy_(kept)
            forget_dropped_step(self.model)
        else:
            self.mark("optimizer step")
            self.clip()
            self.optimizer_step()
        self.schedule()
        output = outputs[0] if self.accum_steps == 1 else torch.cat(outputs)
        return StepResult(loss, output, skipped)
