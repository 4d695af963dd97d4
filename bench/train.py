"""End-to-end training throughput on a generated JPEG ImageFolder, side by side:

  a. ddptrain (its real CLI, on the CPU) against the classic example's loop (bench.classic),
     in fp32 (ddptrain's defaults, so channels_last) and with --amp bf16; each gain set
     against its ceiling measured in the same run: what ddptrain's step alone gains over the
     classic fp32 step on the same in-memory batches and threads (bench.step);
  b. ddptrain against its own compute bound (bench.bound: the same loop fed from memory).

bf16 runs where the CPU has bf16 units (common.native_amp; --amps to choose): elsewhere it is
emulated, slower than fp32. The compute bound is taken in the first of the amps.

So every target is a ratio to a ceiling measured on the same CPU, which means the same on any.

Every contender trains resnet18 at 224 px with the same global batch and loader workers on
the same cores, for EPOCHS epochs; the figure is the last epoch's (see EPOCHS). Repeats
alternate between contenders; medians are reported.

    python -m bench.train [--quick]
"""

import argparse
import collections
import dataclasses
import json
import tempfile
from pathlib import Path

from bench import common

WORKERS = 2
# The last is measured. The first warms up (the train loader's workers start, kernels are
# selected); the second meets the start of the val loader's workers at the first evaluation,
# whose fork costs ddptrain's next training step about a second (1.6 against 0.65 s measured
# here, 0.65 s with the val loader at 0 workers; most likely copy-on-write of the training
# process's pages), 9% of a 16-step epoch and a one-time cost in a real run.
EPOCHS = 3


def lr(s: common.Scale) -> str:
    """The classic example's 0.1 for 256 images, scaled to the batch: at 0.1 a batch of 32
    diverges, and denormal and infinite values slow every CPU kernel down several times."""
    return str(0.1 * s.batch / 256)


# a: the end-to-end gain over the classic loop at least 0.95 of the step-only gain;
# b: end to end at least 0.95 of the compute bound.
TARGETS = {"step": 0.95, "bound": 0.95}
STEPS = {True: 2, False: 10}  # timed steps of bench.step (--quick, full), after its warm-up


def ddptrain(root: Path, s: common.Scale, amp: str, epochs: list[dict]) -> float:
    """samples/s of the last epoch. Appends to `epochs` where that epoch went, against the
    compute bound: its share spent waiting for the loader (metrics.jsonl's data_wait), and the
    cores its training process and its loader workers used meanwhile (/proc): on a CPU run the
    workers decode on the cores the model computes on, which the bound keeps for itself."""
    with tempfile.TemporaryDirectory() as out:
        # The measured epoch: from the line that ends the one before it (after its evaluation
        # and checkpoint) to its own last step's line (before its evaluation).
        start, end = common.run_marking_cpu(
            common.python(
                "-m", "ddptrain", "train", str(root), "-a", "resnet18", "-b", str(s.batch),
                "-j", str(WORKERS), "--epochs", str(EPOCHS), "--image-size", str(s.image_size),
                "--lr", lr(s), "--amp", amp, "--device", "cpu", "-p", "1000000", "--out-dir", out,
                "--progress", "lines",
            ),
            common.subprocess_env(),
            [f"epoch {EPOCHS - 1}/{EPOCHS} done", f"epoch {EPOCHS}/{EPOCHS} ["],
        )  # fmt: skip
        records = [json.loads(line) for line in (Path(out) / "metrics.jsonl").open()]
    last = [r for r in records if r["split"] == "train"][-1]
    facts = {"data_wait": round(last["data_wait"], 3)}
    if start and end and start[1] and end[1]:
        wall = end[0] - start[0]
        used = {name: (end[1][name] - start[1].get(name, 0.0)) / wall for name in end[1]}
        workers = used.pop("pt_data_worker", 0.0)
        facts.update(loader_cores=round(workers, 3), training_cores=round(sum(used.values()), 3))
    epochs.append(facts)
    return last["samples_per_sec"]


def classic(root: Path, s: common.Scale) -> float:
    args = ["-b", str(s.batch), "-j", str(WORKERS), "--image-size", str(s.image_size)]
    args += ["--lr", lr(s)]
    result = common.run_json(
        common.python("-m", "bench.classic", str(root), "--epochs", str(EPOCHS), *args),
        common.subprocess_env(),
    )
    return result["samples_per_sec"][-1]


def bound(root: Path, s: common.Scale, amp: str, epochs: list[dict]) -> float:
    """samples/s of the last epoch; appends to `epochs` the cores it kept busy."""
    args = ["-b", str(s.batch), "-j", str(WORKERS), "--image-size", str(s.image_size)]
    args += ["--lr", lr(s)]
    result = common.run_json(
        common.python("-m", "bench.bound", str(root), "--epochs", str(EPOCHS), "--amp", amp, *args),
        common.subprocess_env(),
    )
    epochs.append({"training_cores": round(result["cores"][-1], 3)})
    return result["samples_per_sec"][-1]


def step(s: common.Scale, variant: str, quick: bool) -> float:
    args = ["-b", str(s.batch), "--image-size", str(s.image_size), "--lr", lr(s)]
    args += ["--steps", str(STEPS[quick]), "--classes", str(s.classes)]
    result = common.run_json(
        common.python("-m", "bench.step", variant, *args), common.subprocess_env()
    )
    return result["samples_per_sec"]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke check")
    parser.add_argument("--repeats", type=int, help="runs of each contender (default: the scale's)")
    parser.add_argument("--amps", nargs="+", choices=("bf16", "none"), help="default: bf16 (where "
                        "the CPU has bf16 units) and none")  # fmt: skip
    args = parser.parse_args(argv)
    quick = args.quick
    amps = args.amps or (["bf16", "none"] if common.native_amp() == "bf16" else ["none"])
    named = {"bf16": "bf16", "none": "fp32"}
    s = common.scale(quick)
    if args.repeats:
        s = dataclasses.replace(s, repeats=args.repeats)
    root = common.jpeg_folder(s)
    contenders = {"classic loop, fp32": lambda: classic(root, s)}
    # each try's measured epoch, by contender: where the time went (`ddptrain`, `bound`)
    epochs: dict[str, list[dict]] = collections.defaultdict(list)
    for amp in amps:
        name = f"ddptrain, {named[amp]}"
        contenders[name] = lambda amp=amp, name=name: ddptrain(root, s, amp, epochs[name])
    bound_name = f"ddptrain compute bound, {named[amps[0]]}"
    contenders[bound_name] = lambda: bound(root, s, amps[0], epochs[bound_name])
    contenders["step only: classic, fp32"] = lambda: step(s, "classic", quick)
    for amp in amps:
        contenders[f"step only: ddptrain, {named[amp]}"] = lambda amp=amp: step(s, amp, quick)
    rows = common.compare(contenders, s, "samples/s")
    classic_e2e, classic_step = "classic loop, fp32", "step only: classic, fp32"
    ratios = []
    for amp in (named[a] for a in amps):
        e2e, only = f"ddptrain, {amp}", f"step only: ddptrain, {amp}"
        ratios += [
            common.paired_ratio(
                f"a. ddptrain {amp} / classic, end to end",
                rows, lambda m, e2e=e2e: m[e2e] / m[classic_e2e], None,
            ),
            common.paired_ratio(
                f"a. ceiling: ddptrain {amp} step / classic step",
                rows, lambda m, only=only: m[only] / m[classic_step], None,
            ),
            common.paired_ratio(
                f"a. ddptrain {amp}: end-to-end gain / step-only gain",
                rows,
                lambda m, e2e=e2e, only=only: (m[e2e] / m[classic_e2e])
                / (m[only] / m[classic_step]),
                TARGETS["step"],
            ),
        ]  # fmt: skip
    first = named[amps[0]]
    ratios.append(
        common.paired_ratio(
            f"b. ddptrain {first} / its compute bound",
            rows,
            lambda m: m[f"ddptrain, {first}"] / m[bound_name],
            TARGETS["bound"],
        )
    )
    settings = {
        "arch": "resnet18",
        "amps": amps,
        "image_size": s.image_size,
        "global_batch": s.batch,
        "workers": WORKERS,
        "lr": float(lr(s)),
        "train_images": s.classes * s.train_per_class,
        "source_images": f"{s.width}x{s.height} JPEG q90",
        "measured": f"the last of {EPOCHS} epochs",
        "step_only": f"{STEPS[quick]} steps after 2 warm-up steps, same batches in memory, "
        "torch's default threads",
        "ratios": "median over repeats of each repeat's ratio (contenders side by side)",
        "repeats": s.repeats,
        # every try, the disturbed ones measured again included
        "measured_epoch": dict(epochs),
        "cores": common.machine()["usable_cores"],
    }
    common.print_table("Training throughput (end to end, CPU)", rows, ratios)
    for name, tries in settings["measured_epoch"].items():
        print(f"  {name}, the measured epoch of each try:")
        for facts in tries:
            print(f"    {epoch_text(facts, settings['cores'])}")
    path = common.write_results("train", quick, settings, rows, ratios)
    print(f"  -> {path}")
    return {"rows": rows, "ratios": ratios}


def epoch_text(facts: dict, cores: int | None) -> str:
    """One try's measured epoch in words: the cores its processes kept busy, and its wait for
    data."""
    busy = f"training process {facts['training_cores']:.2f}" if "training_cores" in facts else ""
    if "loader_cores" in facts:
        busy += f", loader workers {facts['loader_cores']:.2f}"
    text = f"cores busy: {busy} (of {cores})" if busy else "cores busy: not measured"
    if "data_wait" in facts:
        text += f"; waiting for the loader (data_wait) {100 * facts['data_wait']:.0f}%"
    return text


if __name__ == "__main__":
    main()
