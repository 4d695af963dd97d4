"""The training loop makes no host synchronisation outside its print steps."""

import functools

import pytest
import torch
from torch import nn

from ddptrain.config import Config
from ddptrain.data.loaders import Data
from ddptrain.distributed.env import DistEnv
from ddptrain.errors import UserError
from ddptrain.model.precision import Precision
from ddptrain.report.reporter import Reporter
from ddptrain.state.checkpointer import TrainState
from ddptrain.train.preempt import StopRequests
from ddptrain.train.step import Step
from ddptrain.train.trainer import Run, train_epoch

CPU = torch.device("cpu")
ONE = DistEnv(rank=0, world_size=1, local_rank=0, local_world_size=1, device=CPU)
STEPS, BATCH, CLASSES = 6, 4, 3

# What makes the host wait for the device: reading a value, or waiting outright. On the CPU
# they cost nothing, so the test counts the calls instead of timing them.
SYNCING_METHODS = (
    "item",
    "tolist",
    "numpy",
    "cpu",
    "nonzero",
    "__bool__",
    "__float__",
    "__int__",
    "__index__",
)


class SyncCounter:
    def __init__(self, monkeypatch):
        self.calls: list[str] = []
        for name in SYNCING_METHODS:
            method = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self._counting(name, method))
        monkeypatch.setattr(torch.cuda, "synchronize", self._counting("cuda.synchronize", None))

    def _counting(self, name, method):
        @functools.wraps(method or (lambda *a, **k: None))
        def counted(*args, **kwargs):
            self.calls.append(name)
            return None if method is None else method(*args, **kwargs)

        return counted


class MarkedBatches:
    """Preloaded uint8 batches that note how many syncs had happened when each step began."""

    def __init__(self, counter: SyncCounter):
        generator = torch.Generator().manual_seed(0)
        self.batches = [
            (
                torch.randint(0, 256, (BATCH, 3, 8, 8), dtype=torch.uint8, generator=generator),
                torch.randint(0, CLASSES, (BATCH,), generator=generator),
            )
            for _ in range(STEPS)
        ]
        self.counter, self.marks = counter, []

    def __iter__(self):
        for batch in self.batches:
            self.marks.append(len(self.counter.calls))
            yield batch


class Epochs:
    """The sampler's part train_epoch uses."""

    steps = STEPS

    def set_epoch(self, epoch: int, start_step: int = 0) -> None:
        pass


def convnet() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, CLASSES),
    )


@pytest.mark.parametrize(
    "precision",
    [Precision("cpu"), Precision("cpu", amp="bf16", channels_last=True)],
    ids=["fp32", "bf16-channels-last"],
)
def test_no_host_sync_outside_print_steps(monkeypatch, capsys, precision):
    counter = SyncCounter(monkeypatch)
    loader = MarkedBatches(counter)
    model = precision.place(convnet(), CPU)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 30)
    config = Config(print_freq=STEPS + 1, epochs=1)  # only the last step prints
    data = Data(loader, Epochs(), val_loader=[], num_val=0, class_to_idx={})
    with StopRequests(ONE) as stop:
        reporter = Reporter(ONE, None, progress="lines")
        run = Run(
            config, ONE, data, model, optimizer, scheduler, reporter, 0, precision, None, stop
        )
        result = train_epoch(run, 0, TrainState())

    per_step = [b - a for a, b in zip(loader.marks, loader.marks[1:], strict=False)]
    assert len(per_step) == STEPS - 1
    assert per_step == [0] * (STEPS - 1), f"syncs per step: {per_step}, calls: {counter.calls}"
    # The print step and the epoch summary do read values: the counter sees them.
    assert len(counter.calls) > loader.marks[-1]
    assert result["samples"] == STEPS * BATCH
    assert f"[{STEPS}/{STEPS}]" in capsys.readouterr().out


def test_the_finite_flag_lands_on_the_losses_device_when_the_gradients_are_elsewhere():
    # Under --fsdp-offload on a GPU the gradients are in host memory and the losses on the
    # GPU (stacking the two flags failed there). The meta device stands in for the GPU.
    model = nn.Linear(2, 2)
    model(torch.ones(1, 2)).sum().backward()
    step = Step(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert step.finite([torch.tensor(1.0, device="meta")]).device.type == "meta"
    model.weight.grad[0, 0] = float("nan")
    assert not step.finite([torch.tensor(1.0)])


def test_a_forward_of_one_image_into_a_1x1_batch_norm_names_the_flags():
    """-b 4 --accum-steps 4 on a resnet at 16 px: batch norm's ValueError ended the run in a
    traceback."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.AdaptiveAvgPool2d(1), nn.BatchNorm2d(4))
    model = nn.Sequential(model, nn.Flatten())
    step = Step(model, torch.optim.SGD(model.parameters(), lr=0.1), accum_steps=2)
    with pytest.raises(UserError, match="a forward of 1 image per rank .* lower --accum-steps"):
        step(torch.randn(2, 3, 8, 8), torch.tensor([0, 1]))
    step(torch.randn(4, 3, 8, 8), torch.tensor([0, 1, 2, 3]))  # 2 images a forward
