"""FSDP's all-gather and reduce-scatter over gloo as pairwise sends, overlapped with compute.

Gloo's own all_gather_single and reduce_scatter_single move the same bytes at about half the
speed of every pair of ranks exchanging its chunks directly (`bench.collectives`; figures in
docs/performance.md). FSDP2 takes its collectives as objects
(`set_custom_all_gather`, `set_custom_reduce_scatter`); these are those objects for a gloo
group. Each rank sends its chunk to every other rank and receives theirs, all at once: the same
bytes per rank as a ring, in one round.

On the CPU FSDP2 has no streams to overlap its collectives with compute: it waits for each one
where it is issued. So these run in gloo's threads while the step computes (asynchronous p2p):
- the all-gather, when asked for an asynchronous one (`_set_unshard_async_op`, see
  model/fsdp.py), returns a Work that FSDP waits for before it reads the gathered parameters:
  the block that backward needs next is gathered while backward computes the current one;
- the reduce-scatter of one block's gradients runs while backward computes the next block's
  (`PairwiseReduceScatter`).

The reduce-scatter in flight keeps its block's gradients (its input) and (N-1)/N of them more
(what the peers send) until the next block's starts: during the next block's backward, about
one block's gradients more than FSDP2 on gloo's own collectives holds, which the planner's
trace does not count (activations usually dominate the peak; one large unit, as VGG's first
classifier layer, would show it). Asked for a reduction other
than a sum or mean, they hand over to gloo's own collective. FSDP calls them on 2 or more ranks
only.
"""

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.autograd import Variable


class Transfers(dist.Work):
    """Pairwise sends and receives in flight, as one Work (FSDP2 waits on a dist.Work), and what
    to do once they are all done."""

    def __init__(self, works: list[dist.Work], then: Callable[[], None] | None = None):
        super().__init__()
        self._works = works
        self._then = then

    def wait(self, timeout=None) -> bool:
        works, then, self._works, self._then = self._works, self._then, [], None
        for work in works:
            work.wait()
        if then is not None:
            then()
        return True


def _exchange(
    group: dist.ProcessGroup,
    send: list[torch.Tensor],
    receive: dict[int, torch.Tensor],
    then: Callable[[], None] | None = None,
) -> Transfers:
    """Starts sending send[peer] to each other rank of group and receiving its chunk into
    receive[peer], all at once; wait() on what it returns ends them, then runs `then`."""
    me = group.rank()
    ops = []
    for peer in range(group.size()):
        if peer != me:
            ops.append(dist.P2POp(dist.isend, send[peer], group=group, group_peer=peer))
            ops.append(dist.P2POp(dist.irecv, receive[peer], group=group, group_peer=peer))
    return Transfers(dist.batch_isend_irecv(ops), then)


def _at_end_of_backward(callback: Callable[[], None]) -> bool:
    """Runs callback when the backward now running ends, before backward() returns (as FSDP2
    and DDP finish their own reductions); False outside a backward."""
    try:
        Variable._execution_engine.queue_callback(callback)
    except RuntimeError:  # "Final callbacks can only be installed during backward pass"
        return False
    return True


class _PlainAllocation:
    """FSDP2's Comm interface (allocate, then call), duck-typed: its AllGather and ReduceScatter
    base classes live in a private module (torch.distributed.fsdp._fully_shard._fsdp_api)."""

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)


class PairwiseAllGather(_PlainAllocation):
    """output = every rank's input, in rank order; asked for an asynchronous call, the
    Transfers to wait for."""

    def __call__(self, output_tensor, input_tensor, group, async_op=False) -> dist.Work | None:
        chunks = output_tensor.view(group.size(), -1).unbind(0)
        if chunks[group.rank()].data_ptr() != input_tensor.data_ptr():
            chunks[group.rank()].copy_(input_tensor)
        transfers = _exchange(group, [input_tensor] * group.size(), dict(enumerate(chunks)))
        if async_op:
            return transfers
        transfers.wait()
        return None


class PairwiseReduceScatter(_PlainAllocation):
    """output = this rank's chunk of the inputs, summed (or averaged) over the ranks: each rank's
    own part first, then the others' in rank order, the same order on every run.

    A mean asked for inside a backward returns at once, its exchange in flight: it is summed
    into output when this object's next reduce-scatter starts, or when the backward ends,
    whichever comes first (so at most one is in flight: give one object to all of a model's
    groups). FSDP2 (torch 2.14's foreach_reduce) then only views output as the sharded
    gradients, which nothing reads before the backward ends, as long as gradients are reduced
    in the parameters' dtype, none is accumulated into (gradients are None as the backward
    starts: train.step's zero_grad), and none of FSDP2's hooks that read them at once is set
    (post-accumulate-grad hooks, `set_all_reduce_hook`, HSDP's all-reduce): ddptrain sets
    none. A sum is where FSDP2 divides afterwards (fp16 reductions): that one completes before
    it returns, as does any call outside a backward."""

    def __init__(self):
        self._in_flight: Transfers | None = None

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False) -> dist.Work | None:
        average = op == dist.ReduceOp.AVG
        if async_op or not (average or op == dist.ReduceOp.SUM):
            return dist.reduce_scatter_single(
                output_tensor, input_tensor, group=group, op=op, async_op=async_op
            )
        self.finish()
        me, ranks = group.rank(), group.size()
        chunks = input_tensor.view(ranks, -1).unbind(0)
        others = [peer for peer in range(ranks) if peer != me]
        inbox = input_tensor.new_empty((len(others), output_tensor.numel()))
        received = dict(zip(others, inbox, strict=True))

        def reduce() -> None:
            torch.add(chunks[me], received[others[0]], out=output_tensor)  # not copy + add
            for peer in others[1:]:
                output_tensor.add_(received[peer])
            if average:
                output_tensor.div_(ranks)

        self._in_flight = _exchange(group, chunks, received, then=reduce)
        if not (average and _at_end_of_backward(self.finish)):
            self.finish()
        return None

    def finish(self) -> None:
        """Ends the reduce-scatter in flight, if any: its output holds the result."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is not None:
            in_flight.wait()
