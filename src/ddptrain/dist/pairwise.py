"""FSDP's all-gather and reduce-scatter over gloo as pairwise sends.

Gloo's own all_gather_single and reduce_scatter_single move the same bytes at about half the
speed of every pair of ranks exchanging its chunks directly: on 2 ranks over loopback, 96 MiB
of fp32 gathered in 118 against 56 ms, and reduce-scattered in 148 against 71 ms, where a ring
all-reduce of the whole takes 83 (`torchrun --standalone --nproc-per-node 2 -m
bench.collectives` measures them side by side). FSDP2 takes its collectives as objects
(`set_custom_all_gather`, `set_custom_reduce_scatter`); these are those objects for a gloo
group. Each rank sends its chunk to every other rank and receives theirs, all at once, and
waits for all before it returns: the same bytes per rank as a ring, in one round.

The reduce-scatter holds (N-1)/N of a block's gradients more while it runs (what the peers
send), which the planner's trace, on gloo's own collectives, does not count. Asked for an
asynchronous call (`FSDPModule.unshard(async_op=True)`, which ddptrain does not make), or for
a reduction other than a sum or mean, they hand over to gloo's own collective. FSDP calls them
on 2 or more ranks only.
"""

import torch
import torch.distributed as dist


def _exchange(
    group: dist.ProcessGroup, send: list[torch.Tensor], receive: dict[int, torch.Tensor]
) -> None:
    """Sends send[peer] to each other rank of group and receives its chunk into receive[peer],
    all at once; returns when every transfer is done."""
    me = group.rank()
    ops = []
    for peer in range(group.size()):
        if peer != me:
            ops.append(dist.P2POp(dist.isend, send[peer], group=group, group_peer=peer))
            ops.append(dist.P2POp(dist.irecv, receive[peer], group=group, group_peer=peer))
    for work in dist.batch_isend_irecv(ops):
        work.wait()


class _PlainAllocation:
    """FSDP2's Comm interface (allocate, then call), duck-typed: its AllGather and ReduceScatter
    base classes live in a private module (torch.distributed.fsdp._fully_shard._fsdp_api)."""

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)


class PairwiseAllGather(_PlainAllocation):
    """output = every rank's input, in rank order."""

    def __call__(self, output_tensor, input_tensor, group, async_op=False) -> dist.Work | None:
        if async_op:
            return dist.all_gather_single(output_tensor, input_tensor, group=group, async_op=True)
        chunks = output_tensor.view(group.size(), -1).unbind(0)
        if chunks[group.rank()].data_ptr() != input_tensor.data_ptr():
            chunks[group.rank()].copy_(input_tensor)
        _exchange(group, [input_tensor] * group.size(), dict(enumerate(chunks)))
        return None


class PairwiseReduceScatter(_PlainAllocation):
    """output = this rank's chunk of the inputs, summed (or averaged) over the ranks: each rank's
    own part first, then the others' in rank order, the same order on every run."""

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False) -> dist.Work | None:
        average = op == dist.ReduceOp.AVG
        if async_op or not (average or op == dist.ReduceOp.SUM):
            return dist.reduce_scatter_single(
                output_tensor, input_tensor, group=group, op=op, async_op=async_op
            )
        me, ranks = group.rank(), group.size()
        chunks = input_tensor.view(ranks, -1).unbind(0)
        others = [peer for peer in range(ranks) if peer != me]
        inbox = input_tensor.new_empty((len(others), output_tensor.numel()))
        received = dict(zip(others, inbox, strict=True))
        _exchange(group, chunks, received)
        torch.add(chunks[me], received[others[0]], out=output_tensor)  # one pass, not copy + add
        for peer in others[1:]:
            output_tensor.add_(received[peer])
        if average:
            output_tensor.div_(ranks)
        return None
