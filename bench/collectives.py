"""FSDP's collectives over gloo, side by side: gloo's own all-gather and reduce-scatter against
ddptrain's pairwise ones (distributed/pairwise.py), and a ring all-reduce of the same bytes.

    torchrun --standalone --nproc-per-node 2 -m bench.collectives [--mb 96] [--repeats 5]

Rank 0 prints milliseconds per call (the mean of --repeats after one warm-up call) and each
pairwise one against gloo's. One thread per rank, as ddptrain gives 2 ranks on 2 cores.
"""

import argparse
import time
import warnings

import torch
import torch.distributed as dist

from ddptrain.distributed.pairwise import PairwiseAllGather, PairwiseReduceScatter


def timed(call, repeats: int) -> float:
    call()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(repeats):
        call()
    dist.barrier()
    return (time.perf_counter() - start) / repeats * 1000


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=int, default=96, help="bytes gathered or reduced (MB)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")  # gloo's deprecation notices, once per call
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    group, ranks = dist.group.WORLD, dist.get_world_size()
    full = torch.randn(args.mb * 2**20 // 4 // ranks * ranks)
    shard = torch.randn(full.numel() // ranks)
    times = {
        "all-reduce (ring)": lambda: dist.all_reduce(full),
        "all-gather, gloo's": lambda: dist.all_gather_single(full, shard),
        "all-gather, pairwise": lambda: PairwiseAllGather()(full, shard, group),
        "reduce-scatter, gloo's": lambda: dist.reduce_scatter_single(shard, full),
        "reduce-scatter, pairwise": lambda: PairwiseReduceScatter()(
            shard, full, group, dist.ReduceOp.SUM
        ),
    }
    times = {name: timed(call, args.repeats) for name, call in times.items()}
    if dist.get_rank() == 0:
        print(f"{ranks} ranks, gloo, {full.numel() * 4 / 2**20:.0f} MiB of fp32:")
        for name, ms in times.items():
            print(f"  {name:26} {ms:7.1f} ms")
        for kind in ("all-gather", "reduce-scatter"):
            ratio = times[f"{kind}, gloo's"] / times[f"{kind}, pairwise"]
            print(f"  {kind}: pairwise {ratio:.2f}x as fast as gloo's")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
