"""argv -> (command, options): the classic ImageNet example's flags, same names and meaning."""

import argparse

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
        "--pretrained", action="store_true", help="start from the architecture's default weights"
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
    _add_plan_flags(commands.add_parser("plan", help="per-rank memory of a run, ddp against fsdp"))
    return top


def _add_plan_flags(p: argparse.ArgumentParser) -> None:
    d = Config()
    p.add_argument("-a", "--arch", required=True, help="torchvision model name")
    p.add_argument("--world-size", type=int, default=1, help="ranks of the run (default: 1)")
    p.add_argument(
        "-b",
        "--batch-size",
        type=int,
        default=d.batch_size,
        help=f"GLOBAL batch size, summed over all ranks (default: {d.batch_size})",
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


def parse(argv: list[str] | None = None) -> tuple[str, object]:
    """Returns ("train", Config) for train and eval, ("synth", (SynthSpec, OUT)) for synth,
    ("plan", PlanRequest) for plan."""
    args = vars(build_parser().parse_args(argv))
    command = args.pop("command")
    launcher_local_rank = args.pop("launcher_local_rank")
    if command == "synth":
        out = args.pop("out")
        spec = SynthSpec(**{k: v for k, v in args.items()})
        return command, (spec, out)
    if command == "plan":
        from ddptrain.tools.plan import PlanRequest

        return command, PlanRequest(**args)
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
    if command == "plan":
        from ddptrain.tools.plan import run as plan

        plan(options)
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
