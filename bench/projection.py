"""The projection in docs/scaling.md: resnet50 DDP samples/s and scaling efficiency on 8 x H200
per node, from a per-GPU rate measured on one H200 and a ring all-reduce model. Prints the
table; measures nothing. Every constant is explained (and sourced or marked as an assumption)
in the doc.

    python -m bench.projection
"""

import torch
import torchvision

# resnet50 training on one H200 (bf16, channels_last, batch 256, batches preloaded): `RESULT
# bound` of bench/gpu_check.sh, measured once with torch 2.11 (docs/scaling.md)
IMAGES_PER_S = 4538
BACKWARD = 2 / 3  # share of the step's compute in backward (backward ~ 2 x forward)
GPUS = 8  # per node
NVLINK = 350e9  # assumed intra-node NCCL bus bandwidth, bytes/s per GPU
NIC = 0.9 * 50e9  # IB NDR 400 Gb/s, one NIC per GPU, at an assumed 90% of line rate
HOP_NVLINK, HOP_IB = 1e-6, 7.5e-6  # assumed latency of one ring step, s
FIRST, CAP = 2**20, 25 * 2**20  # DDP's first bucket and bucket_cap_mb (torch's defaults)


def buckets(element_bytes: int) -> list[int]:
    """Bucket sizes in bytes, in reduction order, as DDP fills them: parameters in reverse
    order, a bucket closed once it reaches its cap (the first one's is 1 MiB)."""
    with torch.device("meta"):
        model = torchvision.models.resnet50()
    sizes, current = [], 0
    for p in reversed(list(model.parameters())):
        current += p.numel() * 4  # fp32 parameters, fp32 gradients
        if current >= (FIRST if not sizes else CAP):
            sizes.append(current)
            current = 0
    sizes += [current] if current else []
    return [s * element_bytes // 4 for s in sizes]


def allreduce(size: float, nodes: int) -> float:
    """Hierarchical ring: within the node over NVLink, then each GPU's 1/8 shard over its own
    NIC in a ring of `nodes`. Each ring of n ranks moves 2(n-1)/n of its bytes in 2(n-1) steps."""
    t = 2 * (GPUS - 1) / GPUS * size / NVLINK + 2 * (GPUS - 1) * HOP_NVLINK
    if nodes > 1:
        t += 2 * (nodes - 1) / nodes * size / GPUS / NIC + 2 * (nodes - 1) * HOP_IB
    return t


def row(nodes: int, batch: int, hook: str) -> dict:
    sizes = buckets(2 if hook == "bf16" else 4)
    compute = batch / IMAGES_PER_S
    times = [allreduce(s, nodes) for s in sizes]
    # The last bucket (the first layers) is ready only when backward ends; the others hide
    # under backward unless together they take longer.
    exposed = times[-1] + max(0.0, sum(times[:-1]) - BACKWARD * compute)
    step = compute + exposed
    ranks = nodes * GPUS
    return {
        "config": f"{nodes} x {GPUS}, {hook}",
        "global batch": ranks * batch,
        "compute ms": 1e3 * compute,
        "comm ms": 1e3 * sum(times),
        "exposed ms": 1e3 * exposed,
        "samples/s": ranks * batch / step,
        "efficiency": compute / step,
    }


def main() -> None:
    fp32 = buckets(4)
    print(f"resnet50 gradients: {sum(fp32) / 1e6:.1f} MB fp32 in buckets of", end=" ")
    print(", ".join(f"{s / 1e6:.1f}" for s in fp32), "MB (reduction order)")
    rows = [row(n, b, h) for b in (256, 128) for n in (1, 8, 64) for h in ("fp32", "bf16")]
    print(" | ".join(rows[0]))
    for r in rows:
        print(
            f"{r['config']} | {r['global batch']} | {r['compute ms']:.1f} | {r['comm ms']:.2f}"
            f" | {r['exposed ms']:.2f} | {r['samples/s']:,.0f} | {100 * r['efficiency']:.1f}%"
        )


if __name__ == "__main__":
    main()
