"""argv -> (command, options): the classic ImageNet example's flags, same names and meaning."""

import argparse
from pathlib import Path

from ddptrain.config import Config
from ddptrain.data.synth import SynthSpec
from ddptrain.errors import report_errors


class _Parser(argparse.ArgumentParser):
    """Reports mistakes in the project's one-line form, exit 2."""

    def error(self, message: str):
        self.exit(2, f"ddptrain: error: {message} (see '{self.prog} --help')\n")


def _add_train_flags(p: argparse.ArgumentParser) -> None:
    d = Config()
    p.add_argument(
        "data",
        nargs="?",
        metavar="DATA",
        help="ImageFolder root with train/ and val/ (default: the built-in dataset)",
    )
    p.add_argument(
        "-a", "--arch", default=d.arch, help=f"torchvision model name (default: {d.arch})"
    )
    p.add_argument(
        "-j", "--workers", type=int, default=d.workers, help="data loading workers per rank"
    )
    p.add_argument("--epochs", type=int, default=d.epochs, help="total epochs to run")
    p.add_argument(
        "--start-epoch",
        type=int,
        default=d.start_epoch,
        help="manual epoch number (useful on restarts)",
    )
    p.add_argument(
        "-b",
        "--batch-size",
        type=int,
        default=d.batch_size,
        help="GLOBAL batch size, summed over all ranks and nodes",
    )
    p.add_argument(
        "--lr", "--learning-rate", dest="lr", type=float, default=d.lr, help="initial learning rate"
    )
    p.add_argument("--momentum", type=float, default=d.momentum)
    p.add_argument(
        "--wd", "--weight-decay", dest="weight_decay", type=float, default=d.weight_decay
    )
    p.add_argument(
        "-p", "--print-freq", type=int, default=d.print_freq, help="progress line every N steps"
    )
    p.add_argument(
        "--resume",
        metavar="PATH|auto",
        help="checkpoint to resume from; auto: OUT_DIR/checkpoint.pt when present",
    )
    p.add_argument(
        "-e",
        "--evaluate",
        action="store_true",
        help="evaluate the model on the validation set only",
    )
    p.add_argument(
        "--pretrained",
        nargs="?",
        const=True,
        default=False,
        metavar="FILE",
        help="start from the architecture's default torchvision weights, or from FILE: a "
        ".safetensors export or a ddptrain checkpoint (a head of another class count stays new)",
    )
    p.add_argument(
        "--world-size",
        type=int,
        default=d.world_size,
        help="processes (with --multiprocessing-distributed: nodes)",
    )
    p.add_argument(
        "--rank",
        type=int,
        default=d.rank,
        help="process rank (with --multiprocessing-distributed: node rank)",
    )
    p.add_argument(
        "--dist-url", default=d.dist_url, help="rendezvous: env:// (torchrun) or tcp://HOST:PORT"
    )
    p.add_argument(
        "--dist-backend", default=d.dist_backend, help="default: nccl on CUDA, gloo on CPU"
    )
    p.add_argument("--seed", type=int, help="seed everything and use deterministic algorithms")
    p.add_argument("--gpu", type=int, help="use this device index only")
    p.add_argument(
        "--multiprocessing-distributed",
        action="store_true",
        help="spawn --nproc-per-node processes on this node",
    )
    p.add_argument("--dummy", action="store_true", help="use random fake data (throughput tests)")
    p.add_argument(
        "--no-accel", action="store_true", help="run on the CPU even when an accelerator is present"
    )
    p.add_argument(
        "--out-dir", default=d.out_dir, help="where checkpoints, metrics.jsonl and config.json go"
    )
    p.add_argument(
        "--image-size", type=int, help="train crop in px (default 224; 32 on the built-in dataset)"
    )
    p.add_argument(
        "--nproc-per-node",
        type=int,
        help="processes for --multiprocessing-distributed (default: accelerator count, 1 on CPU)",
    )
    p.add_argument("--device", default=d.device, help="auto|cpu|cuda|mps|xpu")
    p.add_argument(
        "--local-rank", "--local_rank", dest="local_rank", type=int, help=argparse.SUPPRESS
    )
    p.add_argument(
        "--dist-timeout",
        type=float,
        default=d.dist_timeout,
        metavar="SECONDS",
        help="how long a rank waits for the others in a collective before giving up",
    )
    p.add_argument(
        "--checkpoint-every",
        type=int,
        default=d.checkpoint_every,
        metavar="N",
        help="also checkpoint every N optimizer steps, mid-epoch (0: at epoch ends only)",
    )
    p.add_argument(
        "--keep-last",
        type=int,
        default=d.keep_last,
        metavar="K",
        help="numbered checkpoints to keep in --out-dir (model_best.pt is kept apart)",
    )
    # Not set: a resumed run keeps its checkpoint's setting.
    p.add_argument("--amp", help="autocast: none, bf16 (CPU and GPU), fp16 (CUDA, GradScaler)")
    p.add_argument(
        "--channels-last",
        action=argparse.BooleanOptionalAction,
        help="NHWC memory format (default: on for convolutional models)",
    )
    p.add_argument(
        "--compile", action=argparse.BooleanOptionalAction, help="torch.compile the model"
    )
    p.add_argument(
        "--strategy",
        default=d.strategy,
        help="ddp: a whole model on every rank; fsdp: parameters, gradients and optimizer "
        "state sharded over the ranks (FSDP2)",
    )
    p.add_argument(
        "--fsdp-offload",
        action="store_true",
        help="fsdp: keep parameters, gradients and optimizer state in host memory",
    )
    p.add_argument(
        "--reshard-after-forward",
        action=argparse.BooleanOptionalAction,
        default=d.reshard_after_forward,
        help="fsdp: free each gathered block after its forward (less memory, one more "
        "all-gather in backward)",
    )


def build_parser() -> argparse.ArgumentParser:
    top = _Parser(
        prog="ddptrain", description="Train image classifiers with PyTorch data parallelism."
    )
    # torch.distributed.launch puts --local-rank=N before the subcommand.
    top.add_argument(
        "--local-rank", "--local_rank", dest="launcher_local_rank", type=int, help=argparse.SUPPRESS
    )
    commands = top.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _add_train_flags(commands.add_parser("train", help="train a classifier"))
    _add_train_flags(commands.add_parser("eval", help="evaluate a checkpoint (train --evaluate)"))
    synth = commands.add_parser("synth", help="write the built-in dataset as an ImageFolder tree")
    s = SynthSpec()
    synth.add_argument("out", metavar="OUT")
    synth.add_argument("--classes", type=int, default=s.classes)
    synth.add_argument("--train-per-class", type=int, default=s.train_per_class)
    synth.add_argument("--val-per-class", type=int, default=s.val_per_class)
    synth.add_argument("--size", type=int, default=s.size, help="image side in px")
    synth.add_argument("--seed", type=int, default=s.seed)
    _add_plot_flags(commands.add_parser("plot", help="draw runs' loss, accuracy, lr, samples/s"))
    _add_export_flags(
        commands.add_parser("export", help="a checkpoint's weights as .safetensors + .json")
    )
    return top


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
        metavar="W.safetensors",
        help="the weights file; W.json beside it describes the model and its input",
    )


def parse(argv: list[str] | None = None) -> tuple[str, object]:
    """Returns ("train", Config) for train and eval, ("synth", (SynthSpec, OUT)) for synth,
    ("plot", (RUN_DIRs, out or None)) and ("export", (CKPT, out))."""
    args = vars(build_parser().parse_args(argv))
    command = args.pop("command")
    launcher_local_rank = args.pop("launcher_local_rank")
    if command == "plot":
        return command, (args["run_dirs"], args["out"])
    if command == "export":
        return command, (args["checkpoint"], args["out"])
    if command == "synth":
        out = args.pop("out")
        spec = SynthSpec(**{k: v for k, v in args.items()})
        return command, (spec, out)
    given = args["pretrained"]
    if isinstance(given, str) and given and args["data"] is None and Path(given).is_dir():
        # The classic example's `--pretrained DATA`: the flag took no value then, and a weights
        # file is never a directory.
        args["data"], args["pretrained"] = args["pretrained"], True
    if args["local_rank"] is None:
        args["local_rank"] = launcher_local_rank
    if command == "eval":
        args["evaluate"] = True
    return "train", Config(**args)


def _run(argv: list[str] | None) -> None:
    command, options = parse(argv)
    if command == "synth":
        from ddptrain.data.synth import write

        spec, out = options
        write(spec, out, progress=True)
        print(f"wrote {spec.describe()} to {out}")
        return
    if command == "plot":
        from ddptrain.report.plot import plot

        print(f"wrote {plot(*options)}")
        return
    if command == "export":
        from ddptrain.tools.export import export, sidecar_path

        checkpoint, out = options
        model = export(checkpoint, out)
        print(
            f"wrote {out} and {sidecar_path(out)} ({model['arch']}, {model['num_classes']} classes)"
        )
        return
    if options.multiprocessing_distributed:
        from ddptrain.dist.launch import spawn

        code = spawn(options)
        if code:
            raise SystemExit(code)
        return
    from ddptrain import run

    run.train(options)


def main(argv: list[str] | None = None) -> int:
    return report_errors(lambda: _run(argv))
