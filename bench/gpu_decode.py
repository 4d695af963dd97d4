"""--decode-device cuda's cost to the training process: one epoch of the train loader alone
(workers read bytes; this process decodes each batch's JPEGs with nvJPEG and transforms them
on the GPU), with the CPU time this process's thread spent in it.

    python -m bench.gpu_decode DATA -b 256 -j 8 [--image-size 224]

prints a JSON line: the decoder, images/s of the loader alone, and the training process's CPU
seconds per 1000 images spent decoding and transforming.
"""

import argparse
import json
import time

import torch

from ddptrain.config import Config
from ddptrain.data import decode
from ddptrain.data.loaders import build_data
from ddptrain.data.sources import open_source
from ddptrain.distributed.env import DistEnv


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("data")
    parser.add_argument("-b", "--batch-size", type=int, default=256)
    parser.add_argument("-j", "--workers", type=int, default=8)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    device = torch.device(args.device)
    config = Config(
        data=args.data, batch_size=args.batch_size, workers=args.workers,
        image_size=args.image_size, decode_device="cuda",
    )  # fmt: skip
    env = DistEnv(rank=0, world_size=1, local_rank=0, local_world_size=1, device=device)
    loader = build_data(config, env, open_source(config), seed=0).train_loader
    start, images = time.perf_counter(), 0
    for batch, _ in loader:
        images += len(batch)
    if device.type == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - start
    print(
        json.dumps(
            {
                "decoder": decode.decoder_name(),
                "images": images,
                "jpegs_on_device": loader.jpegs,
                "images_per_sec": round(images / wall, 1),
                "cpu_seconds_per_1000": round(1000 * loader.cpu_seconds / max(images, 1), 3),
            }
        )
    )


if __name__ == "__main__":
    main()
