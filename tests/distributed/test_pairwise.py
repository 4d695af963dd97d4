"""FSDP's all-gather and reduce-scatter as pairwise sends (distributed/pairwise.py) give what gloo's
own collectives give, on real gloo ranks."""

import pytest
import torch
import torch.distributed as dist
import torchvision
from harness import run_ranks

from ddptrain.distributed.pairwise import PairwiseAllGather, PairwiseReduceScatter

SHARD = 5  # elements per rank


def gather_and_scatter(env, dtype):
    """Ours and gloo's results, by name, as float32 (bf16 has no numpy type to travel in)."""
    group = dist.group.WORLD
    rank_numbers = torch.Generator().manual_seed(env.rank)
    shard = torch.randn(SHARD, generator=rank_numbers).to(dtype)
    results = {}

    gathered = torch.empty(SHARD * env.world_size, dtype=dtype)
    assert PairwiseAllGather()(gathered, shard, group) is None
    results["all_gather"] = gathered
    # FSDP copies its input into the output's own slot first and gathers in place.
    in_place = torch.zeros_like(gathered)
    in_place.chunk(env.world_size)[env.rank].copy_(shard)
    PairwiseAllGather()(in_place, in_place.chunk(env.world_size)[env.rank], group)
    results["all_gather in place"] = in_place
    results["all_gather gloo"] = torch.empty_like(gathered)
    dist.all_gather_single(results["all_gather gloo"], shard)

    grads = torch.randn(SHARD * env.world_size, generator=rank_numbers).to(dtype)
    for name, op in (("sum", dist.ReduceOp.SUM), ("avg", dist.ReduceOp.AVG)):
        results[name] = torch.empty(SHARD, dtype=dtype)
        assert PairwiseReduceScatter()(results[name], grads, group, op) is None
        results[f"{name} gloo"] = torch.empty(SHARD, dtype=torch.float32)
        dist.reduce_scatter_single(results[f"{name} gloo"], grads.float(), op=op)
    return {name: t.float() for name, t in results.items()}


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pairwise_collectives_match_gloos(world, dtype):
    for rank, results in enumerate(run_ranks(gather_and_scatter, world, dtype, timeout=60)):
        assert torch.equal(results["all_gather"], results["all_gather gloo"]), rank
        assert torch.equal(results["all_gather in place"], results["all_gather gloo"]), rank
        # Summed in another order than gloo's (and in bf16 against gloo's fp32): float error.
        tolerance = {} if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
        for name in ("sum", "avg"):
            torch.testing.assert_close(results[name], results[f"{name} gloo"], **tolerance)


def pairs_of_a_subgroup(env):
    """Ranks 1 and 2 of 3 gather over a group of their own, where their ranks are 0 and 1."""
    group = dist.new_group([1, 2])  # every rank joins the call
    if env.rank == 0:
        return None
    shard = torch.full((SHARD,), float(env.rank))
    gathered = torch.empty(2 * SHARD)
    PairwiseAllGather()(gathered, shard, group)
    summed = torch.empty(SHARD)
    PairwiseReduceScatter()(summed, torch.arange(2.0 * SHARD), group, dist.ReduceOp.SUM)
    return gathered, summed


def test_pairwise_collectives_address_ranks_within_their_group():
    _, one, two = run_ranks(pairs_of_a_subgroup, 3, timeout=60)
    expected = torch.tensor([1.0] * SHARD + [2.0] * SHARD)
    assert torch.equal(one[0], expected) and torch.equal(two[0], expected)
    assert torch.equal(one[1], 2 * torch.arange(0.0, SHARD))
    assert torch.equal(two[1], 2 * torch.arange(float(SHARD), 2.0 * SHARD))


def count_fsdp_collectives(env):
    """How often fsdp's step went through the pairwise collectives on this gloo group."""
    from ddptrain.distributed import pairwise
    from ddptrain.model.fsdp import shard

    classes = {
        "all_gather": pairwise.PairwiseAllGather,
        "reduce_scatter": pairwise.PairwiseReduceScatter,
    }
    calls = dict.fromkeys(classes, 0)
    for name, cls in classes.items():
        original = cls.__call__

        def counted(self, *args, _name=name, _original=original, **kwargs):
            calls[_name] += 1
            return _original(self, *args, **kwargs)

        cls.__call__ = counted
    torch.manual_seed(0)
    model = shard(torchvision.models.resnet18(num_classes=3), "resnet18")
    model(torch.randn(2, 3, 16, 16)).sum().backward()
    return [calls["all_gather"], calls["reduce_scatter"]]


def test_fsdp_on_a_cpu_gloo_group_takes_the_pairwise_collectives():
    for all_gathers, reduce_scatters in run_ranks(count_fsdp_collectives, 2, timeout=60):
        # resnet18: 8 blocks and the root; the blocks but the last gather again in backward.
        assert all_gathers == 16 and reduce_scatters == 9


def overlapped_backward(env):
    """fsdp's gradients of resnet18 on a batch per rank, and how its pairwise collectives ran:
    reduce-scatters left in flight as they returned, asynchronous all-gathers, and what was
    still in flight once backward returned. Beside them, the gradients every rank agrees on
    when each computes its own on the whole model and they average them."""
    import copy

    from ddptrain.distributed import pairwise
    from ddptrain.model.fsdp import shard

    seen = {"left in flight": 0, "async all_gathers": 0}
    reduce_scatters = set()
    reduce_scatter, all_gather = pairwise.PairwiseReduceScatter, pairwise.PairwiseAllGather
    original_reduce_scatter, original_all_gather = reduce_scatter.__call__, all_gather.__call__

    def watched_reduce_scatter(self, *args, **kwargs):
        result = original_reduce_scatter(self, *args, **kwargs)
        seen["left in flight"] += self._in_flight is not None
        reduce_scatters.add(self)
        return result

    def watched_all_gather(self, *args, async_op=False, **kwargs):
        seen["async all_gathers"] += async_op
        return original_all_gather(self, *args, async_op=async_op, **kwargs)

    reduce_scatter.__call__ = watched_reduce_scatter
    all_gather.__call__ = watched_all_gather
    torch.manual_seed(0)
    whole = torchvision.models.resnet18(num_classes=3)
    model = shard(copy.deepcopy(whole), "resnet18")
    images = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(env.rank))
    model(images).sum().backward()
    in_flight = sum(each._in_flight is not None for each in reduce_scatters)
    assert len(reduce_scatters) == 1  # one object for all groups: one in flight at most
    sharded = torch.cat([p.grad.full_tensor().flatten() for p in model.parameters()])

    whole(images).sum().backward()
    averaged = torch.cat([p.grad.flatten() for p in whole.parameters()])
    dist.all_reduce(averaged)
    return seen["left in flight"], seen["async all_gathers"], in_flight, sharded, averaged / 2


def test_fsdp_overlaps_its_pairwise_collectives_with_backward_and_ends_them_with_it():
    for left_in_flight, async_gathers, in_flight, sharded, averaged in run_ranks(
        overlapped_backward, 2, timeout=60
    ):
        # 9 groups (8 blocks and the root): each reduce-scatter returned with its exchange in
        # flight; the blocks but the last (kept from forward) gathered again in backward,
        # asynchronously (with the forward's 9).
        assert left_in_flight == 9
        assert async_gathers == 16
        assert in_flight == 0
        torch.testing.assert_close(sharded, averaged, rtol=1e-5, atol=1e-6)
