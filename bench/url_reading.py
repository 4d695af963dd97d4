"""Images/s of the train loader on a packed set read from a local disk, from a URL whose server
answers Range requests (each sample by its bytes), and from one that ignores them (each shard
fetched whole into the local cache on first use, read there after): one epoch each, 1 process,
2 loader workers, side by side in one run, with the local disk as the ceiling. The server is
bench/http_files.py's on 127.0.0.1, so this measures ddptrain's own cost of reading by URL, not
a network.

    python -m bench.url_reading [--quick]
"""

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import torch

from bench import common, http_files
from ddptrain.config import Config
from ddptrain.data.loaders import build_data
from ddptrain.data.pack import pack
from ddptrain.data.sources import open_source
from ddptrain.distributed.env import DistEnv

WORKERS = 2


def images_per_second(data: str, s: common.Scale, cache: Path) -> float:
    config = Config(
        data=data, batch_size=s.batch, workers=WORKERS, image_size=s.image_size, cache_dir=cache
    )
    env = DistEnv(0, 1, 0, 1, torch.device("cpu"))
    loader = build_data(config, env, open_source(config), seed=0).train_loader
    start, images = time.perf_counter(), 0
    for batch, _ in loader:
        images += len(batch)
    return images / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke check")
    s = common.scale(parser.parse_args().quick)
    with tempfile.TemporaryDirectory() as tmp:
        packed = Path(tmp) / "packed"
        pack(str(common.jpeg_folder(s, processes=2)), str(packed), workers=2)
        ranges = http_files.serve(packed, ranges=True)
        whole = http_files.serve(packed, ranges=False)
        contenders = {
            "local disk": str(packed),
            "URL, Range requests": f"http://127.0.0.1:{ranges.server_port}",
            "URL, whole shards cached": f"http://127.0.0.1:{whole.server_port}",
        }
        rates = {name: [] for name in contenders}
        for _ in range(s.repeats):  # interleaved, so a slow moment hits all alike
            for name, data in contenders.items():
                cache = Path(tmp) / "cache"
                shutil.rmtree(cache, ignore_errors=True)  # each epoch fetches its shards anew
                rates[name].append(images_per_second(data, s, cache))
        ranges.shutdown()
        whole.shutdown()
    ceiling = common.median(rates["local disk"])
    print(f"train loader, {WORKERS} workers, {s.width}x{s.height} JPEGs at {s.image_size} px:")
    for name, runs in rates.items():
        rate = common.median(runs)
        print(f"  {name:26s} {rate:8.1f} images/s  {rate / ceiling:5.2f} of the local disk")


if __name__ == "__main__":
    main()
