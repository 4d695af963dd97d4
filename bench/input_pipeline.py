"""The input pipeline on the generated 500x375 JPEG set, side by side in one run:

  per core (1 process, 0 loader workers, 1 thread, process CPU time; bench.pipeline's method):
    classic:        the classic example's PIL ImageFolder -> RandomResizedCrop, flip,
                    ToTensor, Normalize
    folder:         ddptrain's train loader on the JPEG folder (TorchCodec decode -> v2 crop and
                    flip on uint8)
    packed:         the same loader on the set `ddptrain pack` made of the folder (no downscale)
    packed 256:     on the set packed at --max-side 256
  end to end (bench.train's method: the real CLI, 2 loader workers, resnet18 at 224, the last of
  3 epochs): ddptrain from the set packed at --max-side 342, the lower end of what docs/data.md
  advises for 224 px crops, against its compute bound (bench.bound: the same loop and threads
  fed from memory).

Targets: packed >= folder; packed 256 >= 3x classic per core; end to end >= 0.95 of the bound.

    python -m bench.input_pipeline [--quick] [--repeats N] [--tries N] [--amp bf16|none]
                                   [--per-core-only]
"""

import argparse
import dataclasses
import functools
from pathlib import Path

import torch

from bench import common, pipeline, train
from ddptrain.data.pack import pack

TARGETS = {"packed": 1.0, "shrunk": 3.0, "bound": 0.95}
SIDES = {"per_core": 256, "end_to_end": 342}  # --max-side at 224 px crops


def max_side(side: int, s: common.Scale) -> int:
    """A --max-side for 224 px crops, scaled to s's crop (--quick's images are smaller)."""
    return round(side * s.image_size / 224)


def packed(root: Path, side: int | None) -> Path:
    """`ddptrain pack` of root (at --max-side side), made once beside it."""
    out = root.with_name(f"{root.name}-packed-{side or 'full'}")
    if not (out / "index.json").exists():
        pack(str(root), str(out), max_side=side, workers=0)
    return out


def per_core(data: Path, s: common.Scale) -> float:
    return pipeline.images_per_sec(pipeline.ddptrain_loader(data, s))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke check")
    parser.add_argument("--repeats", type=int, help="runs of each contender (default: the scale's)")
    parser.add_argument("--tries", type=int, help="per run while other work disturbs it")
    parser.add_argument("--amp", choices=("bf16", "none"), help="end to end (default: bf16 "
                        "where the CPU has bf16 units, else none)")  # fmt: skip
    parser.add_argument("--per-core-only", action="store_true", help="leave out end to end")
    args = parser.parse_args(argv)
    s = common.scale(args.quick)
    if args.repeats:
        s = dataclasses.replace(s, repeats=args.repeats)
    if args.tries:
        s = dataclasses.replace(s, tries=args.tries)
    root = common.jpeg_folder(s)
    shrunk = max_side(SIDES["per_core"], s)
    sets = {"folder": root, "packed": packed(root, None), f"packed {shrunk}": packed(root, shrunk)}

    torch.set_num_threads(1)  # the per-core contenders run in this process
    amp = args.amp or common.native_amp()
    epochs: dict[str, list[dict]] = {"e2e": [], "bound": []}
    contenders = {"classic (PIL), per core": lambda: pipeline.images_per_sec(
        pipeline.classic_loader(root, s))}  # fmt: skip
    for name, data in sets.items():
        contenders[f"ddptrain {name}, per core"] = functools.partial(per_core, data, s)
    e2e = f"end to end, packed {max_side(SIDES['end_to_end'], s)}"
    if not args.per_core_only:
        for_training = packed(root, max_side(SIDES["end_to_end"], s))
        contenders[e2e] = lambda: train.ddptrain(for_training, s, amp, epochs["e2e"])
        contenders["compute bound"] = lambda: train.bound(for_training, s, amp, epochs["bound"])
    for name, measure in contenders.items():  # warm-up: page cache, first-call costs
        if "per core" in name:
            measure()
    rows = common.compare(contenders, s, "images/s")

    classic, folder = "classic (PIL), per core", "ddptrain folder, per core"
    ratios = [
        common.paired_ratio(
            "ddptrain packed / folder, per core",
            rows, lambda m: m["ddptrain packed, per core"] / m[folder], TARGETS["packed"],
        ),
        common.paired_ratio(
            "ddptrain folder / classic, per core",
            rows, lambda m: m[folder] / m[classic], None,
        ),
        common.paired_ratio(
            f"ddptrain packed {shrunk} / classic, per core",
            rows, lambda m: m[f"ddptrain packed {shrunk}, per core"] / m[classic],
            TARGETS["shrunk"],
        ),
    ]  # fmt: skip
    if not args.per_core_only:
        ratios.append(common.paired_ratio(
            f"{e2e} / compute bound",
            rows, lambda m: m[e2e] / m["compute bound"], TARGETS["bound"],
        ))  # fmt: skip
    settings = {
        "per_core": "1 process, 0 workers, 1 thread, process CPU time, 2 passes over the set",
        "end_to_end": f"resnet18, ddptrain CLI, -j {train.WORKERS}, the last of {train.EPOCHS} "
        f"epochs, --amp {amp}, global batch {s.batch}",
        "image_size": s.image_size,
        "train_images": s.classes * s.train_per_class,
        "source_images": f"{s.width}x{s.height} JPEG q90",
        "max_side": {"per_core": shrunk, "end_to_end": max_side(SIDES["end_to_end"], s)},
        "repeats": s.repeats,
        "measured_epoch": epochs,
        "ratios": "median over repeats of each repeat's ratio (contenders side by side)",
    }
    common.print_table("Input pipeline: images/s per core, and end to end", rows, ratios)
    print(f"  -> {common.write_results('input_pipeline', args.quick, settings, rows, ratios)}")
    return {"rows": rows, "ratios": ratios}


if __name__ == "__main__":
    main()
