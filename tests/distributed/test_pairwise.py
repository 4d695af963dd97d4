"""FSDP's all-gather and reduce-scatter as pairwise sends (dist/pairwise.py) give what gloo's
own collectives give, on real gloo ranks."""

import pytest
import torch
import torch.distributed as dist
from harness import run_ranks

from ddptrain.dist.pairwise import PairwiseAllGather, PairwiseReduceScatter

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
