import itertools

import pytest

from ddptrain.data.sampler import GlobalBatchSampler, shard


def rank_orders(n, batch, world, seed=0, epoch=0):
    samplers = [GlobalBatchSampler(n, batch, r, world, seed) for r in range(world)]
    for s in samplers:
        s.set_epoch(epoch)
    return [list(s) for s in samplers]


def interleave_global(orders, per_rank):
    """Rebuild the global order: for each step, rank 0's slice, then rank 1's, ..."""
    steps = len(orders[0]) // per_rank
    return [
        key
        for step in range(steps)
        for order in orders
        for key in order[step * per_rank : (step + 1) * per_rank]
    ]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_global_order_is_the_same_at_any_world_size(world):
    single = rank_orders(50, 12, 1)[0]
    orders = rank_orders(50, 12, world)
    assert interleave_global(orders, 12 // world) == single


@pytest.mark.parametrize(("before", "after"), [(1, 1), (2, 1), (1, 2), (3, 2)])
def test_an_epoch_resumed_mid_way_continues_the_same_global_order(before, after):
    """Steps 0..k at one world size, then k.. at another: the uninterrupted global order."""
    single = rank_orders(50, 12, 1, epoch=3)[0]
    cut = 2  # global batches done before the interruption
    head = interleave_global(rank_orders(50, 12, before, epoch=3), 12 // before)[: cut * 12]
    resumed = [GlobalBatchSampler(50, 12, r, after, 0) for r in range(after)]
    for sampler in resumed:
        sampler.set_epoch(3, start_step=cut)
    tail = interleave_global([list(s) for s in resumed], 12 // after)
    assert len(resumed[0]) == (4 - cut) * 12 // after
    assert head + tail == single


def test_each_index_once_per_epoch_and_ranks_disjoint():
    orders = rank_orders(50, 12, 3)
    indices = [i for order in orders for i, _ in order]
    assert len(indices) == len(set(indices)) == 48  # 4 full global batches; the tail of 2 dropped
    assert all(len(order) == 16 for order in orders)


def test_epochs_reshuffle_and_seeds_repeat():
    a0, a1 = rank_orders(40, 8, 2, epoch=0), rank_orders(40, 8, 2, epoch=1)
    assert a0 != a1
    assert rank_orders(40, 8, 2, epoch=1) == a1
    assert rank_orders(40, 8, 2, seed=1, epoch=1) != a1


def test_each_sample_keeps_its_augmentation_seed_across_world_sizes():
    seeds_1 = dict(rank_orders(40, 8, 1)[0])
    seeds_4 = dict(itertools.chain.from_iterable(rank_orders(40, 8, 4)))
    assert seeds_4 == {i: seeds_1[i] for i in seeds_4}


def test_length_and_steps():
    s = GlobalBatchSampler(50, 12, 0, 3, 0)
    assert s.steps == 4 and len(s) == 16


@pytest.mark.parametrize(("n", "world"), [(15, 2), (15, 4), (3, 4), (0, 2), (100, 3)])
def test_shard_covers_every_index_once(n, world):
    parts = [shard(n, r, world) for r in range(world)]
    assert [i for p in parts for i in p] == list(range(n))
    assert max(map(len, parts)) - min(map(len, parts)) <= 1
