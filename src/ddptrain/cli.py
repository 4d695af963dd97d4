"""argv -> (command, options): the classic ImageNet example's flags, same names and meaning."""

import argparse
from pathlib import Path

from ddptrain.config import (
    HELP_GROUPS,
    MAX_IMAGE_PIXELS,
    MEMORY_SETTINGS,
    PACK_QUALITY,
    PACK_SHARD_MB,
    OptimSettings,
    flag_name,
    settings,
)
from ddptrain.config_layers import kinds, merge, read, recipes
from ddptrain.data.synth import SynthSpec
from ddptrain.errors import report_errors


class _Parser(argparse.ArgumentParser):
    """Reports mistakes in the project's one-line form, exit 2."""

    def error(self, message: str):
        self.exit(2, f"ddptrain: error: {message} (see '{self.prog} --help')\n")


def _default_text(value) -> str:
    if isinstance(value, tuple):
        return " ".join(_default_text(v) for v in value) or "none"
    return f"{value:g}" if isinstance(value, float) else str(value)


def _add_flag(group, key: str, f) -> None:
    """One train flag, from the field that documents it; `key` is its flat key."""
    scalar, nargs, _ = kinds()[key]
    meta = f.metadata
    names = meta["names"] or (flag_name(key),)
    help_text = meta["help"]
    if help_text is None:
        help_text = argparse.SUPPRESS
    elif f.default is not None and f.default is not False and f.default != ():
        help_text += f" (default: {_default_text(f.default)})"
    kwargs = dict(dest=key, help=help_text)
    if nargs == "?":  # --pretrained [FILE]
        kwargs.update(nargs="?", const=True, metavar=meta["metavar"])
    elif scalar is bool:
        negatable = meta["negatable"]
        kwargs["action"] = argparse.BooleanOptionalAction if negatable else "store_true"
    else:
        choices = meta["choices"]
        metavar = meta["metavar"] or ("|".join(choices) if choices else None)
        if nargs == 2 and metavar is None:
            metavar = ("MIN", "MAX")
        kwargs.update(type=scalar, nargs=nargs, metavar=metavar)
    group.add_argument(*names, **kwargs)


def _add_train_flags(p: argparse.ArgumentParser) -> None:
    """The flags of train and eval, one per setting. No defaults: only the flags given reach
    config_layers.merge, which puts them above a config file and a checkpoint."""
    fields = settings()
    p.add_argument("data", nargs="?", metavar="DATA", help=fields["data"].metadata["help"])
    p.add_argument(
        "--config",
        metavar="FILE|recipe:NAME",
        help="settings from a TOML file (keys: long flag names), a config.json a run wrote, "
        f"or a shipped recipe: {', '.join(recipes())}; flags given here win",
    )
    for title, keys in HELP_GROUPS.items():
        group = p.add_argument_group(title)
        for key in keys:
            _add_flag(group, key, fields[key])


def build_parser() -> argparse.ArgumentParser:
    top = _Parser(
        prog="ddptrain", description="Train image classifiers with PyTorch data parallelism."
    )
    # torch.distributed.launch puts --local-rank=N before the subcommand.
    top.add_argument(
        "--local-rank", "--local_rank", dest="launcher_local_rank", type=int, help=argparse.SUPPRESS
    )
    commands = top.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name, summary in (
        ("train", "train a classifier"),
        ("eval", "evaluate a checkpoint (train --evaluate)"),
    ):
        _add_train_flags(
            commands.add_parser(name, help=summary, argument_default=argparse.SUPPRESS)
        )
    synth = commands.add_parser("synth", help="write the built-in dataset as an ImageFolder tree")
    s = SynthSpec()
    synth.add_argument("out", metavar="OUT")
    synth.add_argument("--classes", type=int, default=s.classes)
    synth.add_argument("--train-per-class", type=int, default=s.train_per_class)
    synth.add_argument("--val-per-class", type=int, default=s.val_per_class)
    synth.add_argument("--size", type=int, default=s.size, help="image side in px")
    synth.add_argument("--seed", type=int, default=s.seed)
    check = commands.add_parser("check", help="decode every image of DATA, list the bad ones")
    check.add_argument(
        "data", metavar="DATA", help="ImageFolder root with train/ and val/, or a table set"
    )
    check.add_argument(
        "-j", "--workers", type=int, help="decoding processes (default: the usable CPUs)"
    )
    check.add_argument(
        "--max-image-pixels",
        type=int,
        default=MAX_IMAGE_PIXELS,
        metavar="N",
        help="an image whose header declares more pixels is bad (a decompression bomb; "
        "default: %(default)s, PIL's)",
    )
    fields = settings()
    for name in ("image_column", "label_column"):  # as train takes them
        _add_flag(check, name, fields[name])
        check.set_defaults(**{name: fields[name].default})
    _add_pack_flags(
        commands.add_parser(
            "pack", help="an ImageFolder or a table set as tar shards (WebDataset) + an index"
        )
    )
    _add_plot_flags(commands.add_parser("plot", help="draw runs' loss, accuracy, lr, samples/s"))
    _add_export_flags(
        commands.add_parser(
            "export", help="a checkpoint's weights as .safetensors, or as an ONNX graph, + .json"
        )
    )
    _add_predict_flags(
        commands.add_parser("predict", help="the top-k classes of image files and folders")
    )
    _add_plan_flags(commands.add_parser("plan", help="per-rank memory of a run, ddp against fsdp"))
    convert = commands.add_parser("convert", help="a sharded checkpoint folder as one file")
    convert.add_argument("source", type=Path, metavar="SRC", help="checkpoint-<step>.dcp folder")
    convert.add_argument("destination", type=Path, metavar="DST", help="the checkpoint file (.pt)")
    return top


def train_parser() -> argparse.ArgumentParser:
    """The parser of `ddptrain train` alone (its flags are eval's too)."""
    return build_parser()._subparsers._group_actions[0].choices["train"]


def _add_pack_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "data",
        metavar="DATA",
        help="ImageFolder root with train/ and val/, or a table set (with --index-only: the "
        "folder of shards)",
    )
    p.add_argument("out", nargs="?", metavar="OUT", help="the packed set's folder")
    p.add_argument(
        "--max-side",
        type=int,
        metavar="PX",
        help="shrink images whose longer side is above PX, never enlarge (default: every "
        "image stored byte for byte)",
    )
    p.add_argument(
        "--quality",
        type=int,
        default=PACK_QUALITY,
        metavar="Q",
        help="JPEG quality of the JPEGs --max-side shrinks (default: %(default)s)",
    )
    p.add_argument(
        "--shard-size",
        type=float,
        default=PACK_SHARD_MB,
        metavar="MB",
        help="bytes of a shard, in millions (default: %(default)s)",
    )
    p.add_argument("-j", "--workers", type=int, help="reading processes (default: the usable CPUs)")
    p.add_argument(
        "--overwrite", action="store_true", help="replace the packed set (or index) there"
    )
    p.add_argument(
        "--index-only",
        action="store_true",
        help="write just DATA/index.json for shards made elsewhere: DATA/train/*.tar and "
        "DATA/val/*.tar of <key>.<image ext> + <key>.cls members; class names from "
        "DATA/classes.txt, else the indices",
    )
    fields = settings()
    for name in ("image_column", "label_column"):  # a table set's, as train takes them
        _add_flag(p, name, fields[name])
        p.set_defaults(**{name: fields[name].default})


def _add_plot_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR", help="--out-dir of a run")
    p.add_argument(
        "-o",
        "--out",
        type=Path,
        metavar="FILE.png",
        help="default: RUN_DIR/metrics.png for one run, ./compare.png for several (.pdf, .svg too)",
    )


def _add_export_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", type=Path, metavar="CKPT", help="a ddptrain checkpoint")
    p.add_argument(
        "--out",
        type=Path,
        required=True,
        metavar="W.safetensors|M.onnx",
        help="the weights file or ONNX graph; W.json beside it describes the model and its input",
    )
    p.add_argument(
        "--format",
        choices=("safetensors", "onnx"),
        default="safetensors",
        help="safetensors: the state dict; onnx: the model as a graph (dynamic batch), checked "
        "with onnxruntime against torch (needs ddptrain[onnx]) (default: %(default)s)",
    )


# The launch settings predict takes, as train takes them: where it runs, and the rendezvous of
# launchers other than torchrun.
PREDICT_LAUNCH = (
    "world_size", "rank", "dist_url", "dist_backend", "gpu", "no_accel", "device", "dist_timeout",
)  # fmt: skip


def _add_predict_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "model",
        type=Path,
        metavar="MODEL",
        help="a checkpoint, a sharded checkpoint folder, or a .safetensors export (its .json "
        "beside it)",
    )
    p.add_argument(
        "inputs",
        nargs="+",
        metavar="INPUT",
        help="image files, and folders (their image files, walked in sorted order)",
    )
    p.add_argument(
        "--out",
        type=Path,
        required=True,
        metavar="FILE",
        help="one row per input, in input order: .csv, .jsonl or .parquet",
    )
    p.add_argument(
        "--topk", type=int, metavar="K", help="classes per input (default: 5, or every class)"
    )
    p.add_argument(
        "--ema", action="store_true", help="the EMA's weights, which the checkpoint holds"
    )
    p.add_argument(
        "--bad-images",
        choices=("column", "error"),
        default="column",
        help="an image that cannot be read: a row with an error column, or stop naming it "
        "(default: %(default)s)",
    )
    fields = settings()
    for name in ("batch_size", "workers", "max_image_pixels", *PREDICT_LAUNCH):  # as in train
        _add_flag(p, name, fields[name])
        p.set_defaults(**{name: fields[name].default})


def _add_plan_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "-a", "--arch", required=True, help="torchvision model name, or timm:NAME[.TAG] for timm's"
    )
    p.add_argument("--world-size", type=int, default=1, help="ranks of the run (default: 1)")
    p.add_argument(
        "-b",
        "--batch-size",
        type=int,
        default=OptimSettings.batch_size,
        help=f"GLOBAL batch size, summed over all ranks (default: {OptimSettings.batch_size})",
    )
    p.add_argument("--image-size", type=int, default=224, help="train crop in px (default: 224)")
    p.add_argument("--amp", default="none", help="none, bf16 or fp16 (default: none)")
    p.add_argument(
        "--num-classes", type=int, default=1000, help="classes of the head (default: 1000)"
    )
    p.add_argument(
        "--device-memory",
        type=float,
        metavar="GiB",
        help="memory of one device (default: this machine's CUDA device, if any)",
    )
    p.add_argument("--json", action="store_true", help="one JSON object keyed ddp and fsdp")
    fields = settings()
    for name in MEMORY_SETTINGS:  # as train takes them
        _add_flag(p, name, fields[name])
        p.set_defaults(**{name: fields[name].default})


def parse(argv: list[str] | None = None) -> tuple[str, object]:
    """Returns ("train", (Config, Layers)) for train and eval (config_layers.merge: the settings,
    and what the file and the flags gave), ("synth", (SynthSpec, OUT)) for synth,
    ("plot", (RUN_DIRs, out or None)), ("export", (CKPT, out, format)), ("convert", (SRC, DST)),
    ("predict", PredictRequest),
    ("check", {"data", "workers", "max_image_pixels", "image_column", "label_column"}),
    ("pack", {"data", "out", ...: pack's flags}) and ("plan", PlanRequest)."""
    args = vars(build_parser().parse_args(argv))
    command = args.pop("command")
    launcher_local_rank = args.pop("launcher_local_rank")
    if command in ("check", "pack"):
        return command, args
    if command == "plot":
        return command, (args["run_dirs"], args["out"])
    if command == "export":
        return command, (args["checkpoint"], args["out"], args["format"])
    if command == "predict":
        return command, _predict_request(args)
    if command == "convert":
        return command, (args["source"], args["destination"])
    if command == "synth":
        out = args.pop("out")
        spec = SynthSpec(**{k: v for k, v in args.items()})
        return command, (spec, out)
    if command == "plan":
        from ddptrain.tools.plan import PlanRequest

        return command, PlanRequest(**args)
    given = args.get("pretrained")
    if isinstance(given, str) and given and "data" not in args and Path(given).is_dir():
        # The classic example's `--pretrained DATA`: the flag took no value then, and a weights
        # file is never a directory.
        args["data"], args["pretrained"] = args["pretrained"], True
    if "local_rank" not in args and launcher_local_rank is not None:
        args["local_rank"] = launcher_local_rank
    if command == "eval":
        args["evaluate"] = True
    spec = args.pop("config", None)
    file = None if spec is None else read(spec)
    return "train", merge(args, file, file_name=f"--config {spec}")


def _run(argv: list[str] | None) -> None:
    command, options = parse(argv)
    if command == "synth":
        from ddptrain.data.synth import write
        from ddptrain.report.progress import say

        spec, out = options
        write(spec, out, say)
        print(f"wrote {spec.describe()} to {out}")
        return
    if command == "check":
        from ddptrain.data.check import check_command
        from ddptrain.report.progress import counting, say

        check_command(**options, say=say, counting=counting)
        return
    if command == "pack":
        _pack(options)
        return
    if command == "plot":
        from ddptrain.report.plot import plot, plot_per_class

        run_dirs, out = options
        print(f"wrote {plot(run_dirs, out)}")
        per_class = plot_per_class(run_dirs[0], out) if len(run_dirs) == 1 else None
        if per_class is not None:
            print(f"wrote {per_class}")
        return
    if command == "export":
        from ddptrain.tools.export import export, sidecar_path

        checkpoint, out, form = options
        if form == "onnx":
            from ddptrain.tools.onnx_export import export_onnx

            model, difference = export_onnx(checkpoint, out)
            print(
                f"wrote {out} and {sidecar_path(out)} ({model['arch']}, {model['num_classes']} "
                f"classes); onnxruntime against torch: largest logit difference {difference:.2e}"
            )
            return
        model = export(checkpoint, out)
        print(
            f"wrote {out} and {sidecar_path(out)} ({model['arch']}, {model['num_classes']} classes)"
        )
        return
    if command == "convert":
        from ddptrain.state.sharded import convert

        source, destination = options
        saved = convert(source, destination)
        print(f"wrote {destination} ({saved['arch']}, global step {saved['global_step']})")
        return
    if command == "predict":
        _start_fork_server(options.workers)
        from ddptrain.report.progress import counting, say
        from ddptrain.tools.predict import predict

        line = predict(options, say, counting)
        if line is not None:  # rank 0's
            print(line, flush=True)
        return
    if command == "plan":
        from ddptrain.tools.plan import answer

        print(answer(options), flush=True)
        return
    config, layers = options
    if not config.launch.multiprocessing_distributed:  # else each spawned rank starts its own
        _start_fork_server(config.data.workers)
    from ddptrain import run

    if config.launch.multiprocessing_distributed:
        from ddptrain.distributed.launch import spawn

        code = spawn(config, layers, run.train)
        if code:
            raise SystemExit(code)
        return
    run.train(config, layers=layers)


def _start_fork_server(workers: int) -> None:
    """The loader workers' fork server, started before this process imports torch: it imports
    what they need meanwhile (data/fork_server.py)."""
    if workers > 0:
        from ddptrain.data import fork_server

        fork_server.start()


def _predict_request(args: dict):
    from ddptrain.config import LaunchSettings
    from ddptrain.tools.predict import PredictRequest

    launch = LaunchSettings(**{name: args.pop(name) for name in PREDICT_LAUNCH})
    return PredictRequest(
        args.pop("model"), args.pop("inputs"), args.pop("out"), **args, launch=launch
    )


def _pack(options: dict) -> None:
    from ddptrain.errors import UserError
    from ddptrain.report.progress import counting_with_lines, say

    data, out = options.pop("data"), options.pop("out")
    if options.pop("index_only"):
        from ddptrain.data.index_shards import index_shards

        if out is not None:
            raise UserError("pack --index-only takes one folder, the shards' (no OUT)")
        print(index_shards(data, options["overwrite"], counting_with_lines))
        return
    if out is None:
        raise UserError("pack needs DATA and OUT (or --index-only SHARDS_ROOT)")
    from ddptrain.data.pack import pack

    print(pack(data, out, **options, say=say, counting=counting_with_lines))


def main(argv: list[str] | None = None) -> int:
    return report_errors(lambda: _run(argv))
