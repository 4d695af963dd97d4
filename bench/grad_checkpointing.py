"""What --grad-checkpointing saves: the rise of a fresh process's peak resident memory over one
forward and backward of a torchvision model, with and without its blocks checkpointed.

    python -m bench.grad_checkpointing -a vit_b_16 -b 16 --image-size 224

prints a JSON line per setting. Each runs in a process of its own, so one's peak does not hide
the other's; on the CPU the resident set is what the allocator took from the system, an upper
bound of what the tensors needed.
"""

import argparse
import json
import resource
import subprocess
import sys

import torch

from ddptrain.model.providers import TORCHVISION


def measure(arch: str, batch: int, image_size: int, checkpointing: bool) -> dict:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = TORCHVISION.build(arch, 100, image_size, False, False)
    if checkpointing:
        TORCHVISION.set_grad_checkpointing(model, arch)
    images = torch.randn(batch, 3, image_size, image_size)
    target = torch.randint(0, 100, (batch,))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    torch.nn.functional.cross_entropy(model(images), target).backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "arch": arch,
        "batch": batch,
        "image_size": image_size,
        "grad_checkpointing": checkpointing,
        "peak_rise_mib": round((peak - before) / 1024),  # ru_maxrss is in KiB on Linux
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("-a", "--arch", default="vit_b_16")
    parser.add_argument("-b", "--batch", type=int, default=16)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--one", choices=("plain", "checkpointing"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        result = measure(args.arch, args.batch, args.image_size, args.one == "checkpointing")
        print(json.dumps(result))
        return
    for setting in ("plain", "checkpointing"):
        command = [sys.executable, "-m", "bench.grad_checkpointing", *sys.argv[1:]]
        subprocess.run([*command, "--one", setting], check=True)


if __name__ == "__main__":
    main()
