"""Gradient accumulation and clipping on real gloo ranks: the same step as the full batch on
one process."""

import itertools

import pytest
import torch
from harness import run_ranks
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.tensor import DTensor

from ddptrain.model.precision import Precision
from ddptrain.parallel import fsdp
from ddptrain.parallel.parallelize import no_gradient_sync, unwrap, wrap
from ddptrain.train.ema import ModelEma
from ddptrain.train.step import Step

BATCH = 8  # global


def bn_free_model():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 3)
    )


def batch():
    generator = torch.Generator().manual_seed(1)
    images = torch.randn(BATCH, 3, 12, 12, generator=generator)
    return images, torch.randint(0, 3, (BATCH,), generator=generator)


def steps(env, accum_steps, clip=None, count=3, strategy="ddp", ema_decay=None):
    """`count` optimizer steps over this rank's slice of the same global batch: the weights
    after them, or with ema_decay, their average (--model-ema) over the steps."""
    model, ema = with_ema(bn_free_model(), env, strategy, ema_decay)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    step = Step(model, optimizer, accum_steps=accum_steps, clip_grad_norm=clip)
    images, target = my_slice(env, *batch())
    for global_step in range(1, count + 1):
        step(images, target)
        if ema is not None:
            ema.update(unwrap(model), global_step)
    kept = unwrap(model) if ema is None else ema.module
    return torch.cat([whole(p).detach().flatten() for p in kept.parameters()])


def with_ema(plain, env, strategy, ema_decay):
    """The model wrapped for `strategy` and, with ema_decay, its EMA as run.py builds it: under
    fsdp into a twin sharded alike."""
    sharded = ema_decay is not None and strategy == "fsdp"
    structure = fsdp.meta_copy(plain) if sharded else None
    model = wrap(plain, env, strategy=strategy)
    averaged = None if structure is None else fsdp.shard_twin(structure, env, "test model")
    ema = None if ema_decay is None else ModelEma(unwrap(model), env, ema_decay, averaged=averaged)
    return model, ema


def my_slice(env, images, target):
    per_rank = BATCH // env.world_size
    mine = slice(env.rank * per_rank, (env.rank + 1) * per_rank)
    return images[mine], target[mine]


def whole(parameter: torch.Tensor) -> torch.Tensor:
    """An fsdp parameter's full tensor (every rank's shard), gathered: a collective."""
    return parameter.full_tensor() if isinstance(parameter, DTensor) else parameter


@pytest.fixture(scope="module")
def full_batch_on_one_process():
    return run_ranks(steps, 1, 1)[0]


@pytest.mark.parametrize("accum_steps", [2, 4])
def test_accumulated_micro_batches_on_two_ranks_equal_the_full_batch(
    full_batch_on_one_process, accum_steps
):
    first, second = run_ranks(steps, 2, accum_steps)
    assert torch.equal(first, second)
    assert not torch.equal(first, torch.cat([p.flatten() for p in bn_free_model().parameters()]))
    torch.testing.assert_close(first, full_batch_on_one_process, rtol=0, atol=1e-5)


def test_accumulation_and_clipping_under_fsdp_equal_one_process():
    (single,) = run_ranks(steps, 1, 1, 0.05)
    first, second = run_ranks(steps, 2, 2, 0.05, 3, "fsdp")
    assert torch.equal(first, second)
    torch.testing.assert_close(first, single, rtol=0, atol=1e-5)


def test_accumulation_all_reduces_in_the_last_micro_step_only():
    once = run_ranks(_all_reduces_in_a_step, 2, 1)
    assert once[0] > 0 and run_ranks(_all_reduces_in_a_step, 2, 4) == once


def _all_reduces_in_a_step(env, accum_steps):
    """How many buckets DDP all-reduced in one optimizer step of accum_steps micro-batches."""
    model = wrap(bn_free_model(), env)
    reduced = []

    def counting(process_group, bucket):
        reduced.append(bucket.index())
        return default_hooks.allreduce_hook(process_group, bucket)

    model.register_comm_hook(None, counting)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    Step(model, optimizer, accum_steps=accum_steps)(*my_slice(env, *batch()))
    return len(reduced)


def _gradient_storage_in_accumulated_steps(env):
    """Where each gradient lives during the backward passes of three accumulated steps: the
    distinct storages seen per parameter, and whether each was one of DDP's buckets."""
    model = wrap(bn_free_model(), env)
    seen = {name: set() for name, _ in model.module.named_parameters()}
    for name, param in model.module.named_parameters():
        param.register_post_accumulate_grad_hook(
            lambda p, name=name: seen[name].add(p.grad.untyped_storage().data_ptr())
        )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    step = Step(model, optimizer, accum_steps=2)
    images, target = my_slice(env, *batch())
    step(images, target)  # the first: DDP makes its gradients views of its buckets at the end
    for ptrs in seen.values():
        ptrs.clear()
    for _ in range(2):
        step(images, target)
    buckets = {p.grad.untyped_storage().data_ptr() for p in model.parameters()}
    return {name: (len(ptrs), ptrs <= buckets) for name, ptrs in seen.items()}


def test_accumulating_under_ddp_keeps_the_gradients_in_its_buckets():
    """Zeroed there, not set to None: the backward passes in no_sync then accumulate into the
    buckets instead of making a second set of gradients beside them."""
    for per_parameter in run_ranks(_gradient_storage_in_accumulated_steps, 2):
        assert set(per_parameter.values()) == {(1, True)}, per_parameter


def test_loss_scaling_skips_and_steps_alike_with_gradients_zeroed_in_the_buckets():
    """--amp fp16's GradScaler (here on the CPU, in fp32: the scaler's path is the same) unscales
    the gradients in DDP's buckets, skips the steps whose gradients overflow and lowers its
    scale: on 2 ranks, bitwise the same weights and scales as with the gradients set to None
    between steps (a skipped step's inf must not stay in a bucket)."""
    zeroed, set_to_none = (
        run_ranks(_loss_scaled_steps, 2, False),
        run_ranks(_loss_scaled_steps, 2, True),
    )
    (scales, weights, moved), (_, rank1_weights, _) = zeroed
    assert (scales, weights.tolist()) == (set_to_none[0][0], set_to_none[0][1].tolist())
    assert torch.equal(weights, rank1_weights)
    # The scale doubles after each step taken (growth_interval 1) and halves at each skipped,
    # which leaves the weights as they were; both happen (which steps overflow is the CPU's).
    changes = [later / earlier for earlier, later in itertools.pairwise(scales)]
    assert changes == [2.0 if step_taken else 0.5 for step_taken in moved], (changes, moved)
    assert any(moved) and not all(moved), moved


def _loss_scaled_steps(env, set_to_none):
    """The loss scale before and after each of 10 accumulated steps under DDP, the weights
    after them and whether each step moved them. The scale grows at each step taken until the
    gradients overflow."""
    model = wrap(bn_free_model(), env)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.005, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**119, growth_interval=1)
    step = Step(model, optimizer, Precision(scaler=scaler), accum_steps=2)
    assert not step.set_to_none  # what is under test: zeroed in the buckets
    step.set_to_none = set_to_none
    images, target = my_slice(env, *batch())

    def weights():
        return torch.cat([p.detach().flatten() for p in model.module.parameters()])

    scales, moved = [scaler.get_scale()], []
    for _ in range(10):
        before = weights()
        step(images * 100, target)
        scales.append(scaler.get_scale())
        moved.append(not torch.equal(weights(), before))
    return scales, weights(), moved


def test_the_average_of_the_weights_on_two_ranks_equals_one_process():
    """--model-ema-decay is per optimizer step of the global batch: the same average at any
    world size."""
    (single,) = run_ranks(steps, 1, 1, None, 3, "ddp", 0.5)
    first, second = run_ranks(steps, 2, 1, None, 3, "ddp", 0.5)
    assert not torch.allclose(single, run_ranks(steps, 1, 1)[0], atol=1e-4)  # averaged
    assert torch.equal(first, second)
    torch.testing.assert_close(first, single, rtol=0, atol=1e-5)


def test_the_average_under_fsdp_is_the_average_under_ddp():
    """Each fsdp rank averages its shards into the twin's shards: after each step the averaged
    model's output (an evaluation gathers the new average, not the one gathered before) and
    its weights at the end are ddp's."""
    ddp = run_ranks(_evaluated_average, 2, "ddp")
    fsdp = run_ranks(_evaluated_average, 2, "fsdp")
    assert torch.equal(ddp[0][1], ddp[1][1]) and torch.equal(fsdp[0][1], fsdp[1][1])
    for (ddp_outputs, ddp_weights), (fsdp_outputs, fsdp_weights) in zip(ddp, fsdp, strict=True):
        torch.testing.assert_close(fsdp_outputs, ddp_outputs, rtol=0, atol=1e-5)
        torch.testing.assert_close(fsdp_weights, ddp_weights, rtol=0, atol=1e-5)
    assert not torch.allclose(ddp[0][0][0], ddp[0][0][-1], atol=1e-4)  # the average moved


class Headed(nn.Module):
    """A model whose head stays in fsdp's root unit (fsdp.shard_units takes the children of
    `features`), which FSDP keeps gathered after a forward without backward. BatchNorm-free
    unless `norm`."""

    def __init__(self, norm: bool = False):
        super().__init__()
        torch.manual_seed(0)
        norms = [nn.BatchNorm2d(8)] if norm else []
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3), *norms, nn.ReLU())
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 3))

    def forward(self, x):
        return self.head(self.features(x))


def _evaluated_average(env, strategy):
    model, ema = with_ema(Headed(), env, strategy, 0.5)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    step = Step(model, optimizer)
    images, target = my_slice(env, *batch())
    outputs = []
    for global_step in range(1, 5):
        step(images, target)
        ema.update(unwrap(model), global_step)
        with torch.no_grad():
            outputs.append(ema.module.eval()(images))
    weights = torch.cat([whole(p).detach().flatten() for p in ema.module.parameters()])
    return torch.stack(outputs), weights


def test_the_fsdp_average_goes_through_a_single_file_and_back():
    """ModelEma.state_dict gathers the whole average to rank 0 (the single-file format), and
    load_state_dict sends rank 0's back into every rank's shards."""
    (whole_on_rank0, restored), (nothing_on_rank1, _) = run_ranks(_round_trip, 2)
    assert whole_on_rank0 and not nothing_on_rank1
    assert restored


def _round_trip(env):
    model, ema = with_ema(Headed(norm=True), env, "fsdp", 0.5)
    step = Step(model, torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9))
    for global_step in range(1, 4):
        step(*my_slice(env, *batch()))
        ema.update(unwrap(model), global_step)
    saved = ema.state_dict()
    _, other = with_ema(Headed(norm=True), env, "fsdp", 0.5)
    with torch.no_grad():
        for tensor in (*other.module.parameters(), *other.module.buffers()):
            tensor.add_(1)  # another average, BatchNorm statistics included
    other.load_state_dict(saved)
    tensors = [(*m.parameters(), *m.buffers()) for m in (ema.module, other.module)]
    same = all(torch.equal(whole(a), whole(b)) for a, b in zip(*tensors, strict=True))
    return len(saved["model"]) == len(ema.module.state_dict()), same and other.updates == 3


def test_no_gradient_sync_reaches_ddp_under_torch_compile():
    assert run_ranks(_sync_inside_compiled, 2) == [False, False]


def _sync_inside_compiled(env):
    ddp = wrap(bn_free_model(), env)
    with no_gradient_sync(torch.compile(ddp)):  # compiles nothing until called
        return ddp.require_backward_grad_sync


def test_clipping_on_two_ranks_equals_one_process():
    (single,) = run_ranks(steps, 1, 1, 0.05)
    unclipped = run_ranks(steps, 1, 1)[0]
    first, second = run_ranks(steps, 2, 2, 0.05)
    assert not torch.allclose(single, unclipped, atol=1e-4)  # the clip bit
    assert torch.equal(first, second)
    torch.testing.assert_close(first, single, rtol=0, atol=1e-5)
