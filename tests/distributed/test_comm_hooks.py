"""--ddp-comm-hook on 2 gloo ranks: each hook trains; bf16 and fp16 compression stay close to
the plain all-reduce; PowerSGD's state goes through the Checkpointer exactly, and a resumed
PowerSGD run is bitwise the uninterrupted one."""

from pathlib import Path

import pytest
import torch
from harness import run_ranks
from torch import nn

from ddptrain.config import ParallelSettings
from ddptrain.parallel.parallelize import checkpoint_parts, unwrap, wrap
from ddptrain.state.checkpointer import Checkpointer, TrainState, training_parts
from ddptrain.state.files import LATEST, load

STEPS = 6
# Tiny buckets for the compression hooks: several all-reduces per step.
SMALL_BUCKETS = 0.002  # MB


def model_and_optimizer(env, hook: str, shared_shapes: bool = False, laid_out: bool = True):
    torch.manual_seed(0)
    net = shared_shapes_net() if shared_shapes else small_net()
    buckets = None if hook == "powersgd" else SMALL_BUCKETS  # powersgd: one bucket on gloo
    comm = ParallelSettings(
        ddp_comm_hook=hook, powersgd_rank=2, powersgd_start_step=2, bucket_cap_mb=buckets
    )
    # As run.py wraps: DDP's buckets laid out before the first step, as a resumed run meets them.
    example = torch.zeros(2, 3, 16, 16) if laid_out else None
    model = wrap(net, env, comm=comm, example=example)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model, optimizer


def small_net() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3),
        nn.ReLU(),
        nn.Conv2d(8, 16, 3),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, 10),
    )


def shared_shapes_net() -> nn.Module:
    """Two convolutions of one shape with another between them: PowerSGD lays its memories
    out grouped by shape, so their order is not the parameters' order in either of DDP's
    bucket layouts (as in a resnet)."""
    return nn.Sequential(
        nn.Conv2d(3, 8, 3),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(8, 16, 1),
        nn.ReLU(),
        nn.Conv2d(16, 8, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 10),
    )


def train_steps(model, optimizer, env, steps: range) -> list[float]:
    losses = []
    for step in steps:
        generator = torch.Generator().manual_seed(step)  # one global batch of 8 per step
        images = torch.randn(8, 3, 16, 16, generator=generator)
        target = torch.randint(0, 10, (8,), generator=generator)
        mine = slice(4 * env.rank, 4 * env.rank + 4)
        loss = nn.functional.cross_entropy(model(images[mine]), target[mine])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def flat(model) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in unwrap(model).parameters()])


def train_with(env, hook: str):
    model, optimizer = model_and_optimizer(env, hook)
    losses = train_steps(model, optimizer, env, range(STEPS))
    assert all(torch.isfinite(torch.tensor(losses)))
    return flat(model)


@pytest.fixture(scope="module")
def plain():
    return run_ranks(train_with, 2, "none")[0]


@pytest.mark.parametrize("hook", ["bf16", "fp16", "powersgd"])
def test_each_hook_trains_the_same_model_on_both_ranks(hook, plain):
    a, b = run_ranks(train_with, 2, hook)
    assert torch.equal(a, b)
    assert not torch.equal(a, plain)  # the hook did change the communication
    start = run_ranks(initial_weights, 1)[0]
    assert not torch.equal(a, start)  # and the model trained


def initial_weights(env):
    model, _ = model_and_optimizer(env, "none")
    return flat(model)


@pytest.mark.parametrize(("hook", "tolerance"), [("bf16", 5e-3), ("fp16", 5e-4)])
def test_compression_stays_within_a_bound_of_the_plain_all_reduce(hook, tolerance, plain):
    """After 6 SGD steps, every weight within `tolerance` of the uncompressed run's (bf16 keeps
    8 bits of mantissa, fp16 11: about 4e-3 and 5e-4 of relative rounding per gradient)."""
    compressed = run_ranks(train_with, 2, hook)[0]
    assert (compressed - plain).abs().max().item() < tolerance


def checkpointer(model, optimizer, env, out_dir: Path) -> Checkpointer:
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=100)
    parts = training_parts(unwrap(model), optimizer, scheduler, env)
    parts.update(checkpoint_parts(model, env))
    return Checkpointer(env, out_dir, parts, {"arch": "tiny"}, {}, keep_last=2)


def powersgd_state_round_trip(env, out_dir: str):
    """PowerSGD's state after 4 steps, saved by the Checkpointer, read back into a fresh DDP."""
    model, optimizer = model_and_optimizer(env, "powersgd")
    train_steps(model, optimizer, env, range(4))
    checkpointer(model, optimizer, env, Path(out_dir)).save(TrainState(global_step=4))
    before = model.powersgd_state
    fresh, fresh_optimizer = model_and_optimizer(env, "powersgd")
    checkpointer(fresh, fresh_optimizer, env, Path(out_dir)).restore(load(Path(out_dir) / LATEST))
    after = fresh.powersgd_state
    assert after.iter == before.iter == 4
    assert after.layouts == before.layouts and before.layouts
    assert after.rng.get_state()[2] == before.rng.get_state()[2]
    for name in ("error_dict", "p_memory_dict", "q_memory_dict"):
        mine, theirs = getattr(before, name), getattr(after, name)
        assert mine.keys() == theirs.keys() and mine, name
        assert all(torch.equal(mine[k], theirs[k]) for k in mine), name
    return torch.cat([e.flatten() for e in after.error_dict.values()])


def test_powersgd_state_goes_through_the_checkpointer_rank_by_rank(tmp_path):
    errors = run_ranks(powersgd_state_round_trip, 2, str(tmp_path))
    assert not torch.equal(errors[0], errors[1])  # each rank got its own error feedback back


def first_four_powersgd_steps(env, out_dir: str) -> None:
    model, optimizer = model_and_optimizer(env, "powersgd", shared_shapes=True)
    train_steps(model, optimizer, env, range(4))
    checkpointer(model, optimizer, env, Path(out_dir)).save(TrainState(global_step=4))


def resumed_powersgd(
    env, out_dir: str, layouts: bool = True, laid_out: bool = True, memories: bool = True
) -> tuple[torch.Tensor, list, int]:
    """4 more steps in new processes, from the checkpoint of the first 4, as a restart does;
    the weights, the losses, and the step from which PowerSGD compresses. layouts=False: as if
    the checkpoint were written before the state's layouts were saved. laid_out=False: DDP
    wrapped without lay_out_buckets, whose first bucket is in the parameters' order.
    memories=False: the saved state without its error feedback and low-rank memories."""
    fresh, fresh_optimizer = model_and_optimizer(env, "powersgd", True, laid_out)
    saved = load(Path(out_dir) / LATEST)
    if not layouts:
        del saved["powersgd"]["layouts"]
    if not memories:
        saved["powersgd"].update(p_memory={}, q_memory={}, errors_by_rank=None)
    checkpointer(fresh, fresh_optimizer, env, Path(out_dir)).restore(saved)
    start = fresh.powersgd_state.start_powerSGD_iter
    losses = train_steps(fresh, fresh_optimizer, env, range(4, 8))
    return flat(fresh), losses, start


def uninterrupted_powersgd(env) -> torch.Tensor:
    model, optimizer = model_and_optimizer(env, "powersgd", shared_shapes=True)
    train_steps(model, optimizer, env, range(8))
    return flat(model)


def test_a_resumed_powersgd_run_is_bitwise_the_uninterrupted_one(tmp_path):
    # The resumed processes' first step compresses with the saved state, in the bucket layout
    # it was saved in (tests/e2e/test_comm_hook_cli.py resumes a resnet18 through the CLI).
    run_ranks(first_four_powersgd_steps, 2, str(tmp_path))
    resumed = run_ranks(resumed_powersgd, 2, str(tmp_path))
    uninterrupted = run_ranks(uninterrupted_powersgd, 2)
    for (weights, losses, start), straight in zip(resumed, uninterrupted, strict=True):
        assert start == 2  # PowerSGD compressed the first step after the resume too
        assert all(torch.isfinite(torch.tensor(losses)))
        assert torch.equal(weights, straight)


def test_a_checkpoint_without_layouts_resumes_close_with_a_plain_first_step(tmp_path):
    # Its state has the layout of a process's later steps, which the first step does not have.
    run_ranks(first_four_powersgd_steps, 2, str(tmp_path))
    weights, losses, start = run_ranks(resumed_powersgd, 2, str(tmp_path), False)[0]
    uninterrupted = run_ranks(uninterrupted_powersgd, 2)[0]
    assert start == 5  # step 4, the first after the resume, all-reduced plainly
    assert all(torch.isfinite(torch.tensor(losses)))
    assert (weights - uninterrupted).abs().max().item() < 5e-2


def test_a_state_met_in_another_bucket_order_starts_over(tmp_path):
    # Saved in the gradients' ready order, read in the parameters' (a DDP not laid out): fed as
    # it was, it would mix up their errors and memories (it sent a resnet18 non-finite), so
    # the run goes on as if none had been saved.
    run_ranks(first_four_powersgd_steps, 2, str(tmp_path))
    weights, losses, start = run_ranks(resumed_powersgd, 2, str(tmp_path), True, False)[0]
    without = run_ranks(resumed_powersgd, 2, str(tmp_path), True, False, False)[0]
    assert start == 2 and all(torch.isfinite(torch.tensor(losses)))
    assert torch.equal(weights, without[0])
