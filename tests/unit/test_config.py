import subprocess
import sys

import pytest

from ddptrain.cli import parse
from ddptrain.config import Config
from ddptrain.config_layers import Layers, check_batch_divides_early
from ddptrain.errors import UserError


def test_defaults_follow_the_classic_example():
    c = Config(data="/data")
    assert (
        c.model.arch,
        c.data.workers,
        c.optim.epochs,
        c.optim.batch_size,
        c.optim.lr,
        c.optim.momentum,
        c.optim.weight_decay,
    ) == (
        "resnet18",
        4,
        90,
        256,
        0.1,
        0.9,
        1e-4,
    )
    assert (
        c.launch.dist_url == "env://" and c.launch.dist_backend is None and c.data.image_size == 224
    )


def test_builtin_dataset_gets_its_own_image_size():
    assert Config().data.image_size == 32
    assert Config(image_size=64).data.image_size == 64
    assert Config(dummy=True).data.image_size == 224


@pytest.mark.parametrize(
    ("field", "value", "flag"),
    [
        ("batch_size", 0, "--batch-size"),
        ("workers", -1, "--workers"),
        ("epochs", -1, "--epochs"),
        ("lr", -0.1, "--lr"),
        ("weight_decay", -1.0, "--weight-decay"),
        ("print_freq", 0, "--print-freq"),
        ("image_size", 8, "--image-size"),
        ("arch", "get_model", "--arch"),
        ("arch", "resnet9000", "--arch"),
        ("device", "tpu", "--device"),
        ("dist_backend", "carrier-pigeon", "--dist-backend"),
        ("dist_url", "http://x", "--dist-url"),
        ("world_size", 0, "--world-size"),
        ("dist_timeout", 0.5, "--dist-timeout"),
        ("seed", -1, "--seed"),  # a traceback from numpy after every rank had set up
        ("seed", 2**64, "--seed"),
    ],
)
def test_bad_values_name_their_flag(field, value, flag):
    with pytest.raises(UserError, match=flag):
        Config(**{field: value})


def test_contradictions_are_refused():
    with pytest.raises(UserError, match="--rank"):
        Config(world_size=2, rank=2)
    with pytest.raises(UserError, match="--no-accel"):
        Config(no_accel=True, device="cuda")
    with pytest.raises(UserError, match="--gpu"):
        Config(gpu=0, device="cpu")
    with pytest.raises(UserError, match="--evaluate"):
        Config(evaluate=True)
    with pytest.raises(UserError, match="--nproc-per-node"):
        Config(nproc_per_node=2)


def test_mistakes_are_named_before_torchvision_is_imported_for_the_arch_check():
    """Its list of architectures takes seconds to import: a mistake in another setting, or in
    how settings combine, is named without waiting for it."""
    script = (
        "import sys\n"
        "from ddptrain.config import Config\n"
        "from ddptrain.errors import UserError\n"
        "for flat in ({'lr': -1.0}, {'evaluate': True}, {'fsdp_offload': True}):\n"
        "    try:\n"
        "        Config(**flat)\n"
        "    except UserError:\n"
        "        pass\n"
        "print('torchvision' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert done.stdout.strip() == "False", done.stderr


def test_batch_must_divide_the_world():
    Config(batch_size=8).check_batch_divides(4)
    with pytest.raises(UserError, match="--batch-size 6 .* 4 ranks"):
        Config(batch_size=6).check_batch_divides(4)
    Config(batch_size=16, accum_steps=2).check_batch_divides(4)  # 4 a rank: 2 micro-batches of 2
    with pytest.raises(UserError, match=r"--accum-steps 3 must divide .* \(4 on 4 rank\(s\)\)"):
        Config(batch_size=16, accum_steps=3).check_batch_divides(4)


def test_cli_maps_the_classic_flags():
    command, (c, _) = parse(
        [
            "train",
            "/d",
            "-a",
            "resnet34",
            "-j",
            "2",
            "-b",
            "64",
            "--learning-rate",
            "0.5",
            "--wd",
            "0.01",
            "-p",
            "3",
            "--resume",
            "auto",
            "--seed",
            "7",
            "--dist-url",
            "tcp://127.0.0.1:1234",
            "--world-size",
            "2",
            "--rank",
            "1",
            "--out-dir",
            "o",
        ]
    )
    assert command == "train"
    assert (
        c.data.root,
        c.model.arch,
        c.data.workers,
        c.optim.batch_size,
        c.optim.lr,
        c.optim.weight_decay,
    ) == (
        "/d",
        "resnet34",
        2,
        64,
        0.5,
        0.01,
    )
    assert (
        c.report.print_freq,
        c.checkpoint.resume,
        c.optim.seed,
        c.launch.world_size,
        c.launch.rank,
    ) == (3, "auto", 7, 2, 1)


def test_cli_accepts_local_rank_where_torch_distributed_launch_puts_it():
    _, (c, _) = parse(["--local-rank=1", "train", "/d"])
    assert c.launch.local_rank == 1
    _, (c, _) = parse(["train", "/d", "--local_rank", "0"])
    assert c.launch.local_rank == 0


def test_eval_is_train_evaluate():
    _, (c, _) = parse(["eval", "/d", "--resume", "ckpt.pt"])
    assert c.checkpoint.evaluate and c.checkpoint.resume == "ckpt.pt"


def test_synth_command():
    command, (spec, out) = parse(["synth", "out", "--classes", "4", "--size", "20"])
    assert command == "synth" and out == "out" and (spec.classes, spec.size) == (4, 20)


def test_precision_flags():
    _, (c, _) = parse(["train", "--amp", "bf16", "--no-channels-last", "--compile"])
    assert (c.model.amp, c.model.channels_last, c.model.compile) == ("bf16", False, True)
    _, (c, _) = parse(["train"])
    assert (c.model.amp, c.model.channels_last, c.model.compile) == (
        None,
        None,
        None,
    )  # resolved at run time


@pytest.mark.parametrize(
    ("overrides", "flag"),
    [
        ({"crop_scale": (0.0, 1.0)}, "--crop-scale"),
        ({"crop_scale": (0.9, 0.5)}, "--crop-scale"),
        ({"crop_ratio": (2.0, 1.0)}, "--crop-ratio"),
        ({"hflip": 1.5}, "--hflip"),
        ({"random_erase": -0.1}, "--random-erase"),
        ({"ra_magnitude": 31}, "--ra-magnitude"),
        ({"auto_augment": "fancy"}, "--auto-augment"),
        ({"interpolation": "lanczos"}, "--interpolation"),
        ({"val_crop": 8}, "--val-crop"),
        ({"val_crop": 0}, "--val-crop"),  # not the train crop, as a missing one would be
        ({"image_size": 64, "val_resize": 60}, "--val-resize"),
        ({"label_smoothing": 1.0}, "--label-smoothing"),
        ({"mixup_alpha": -1.0}, "--mixup-alpha"),
        ({"opt": "lamb"}, "--opt"),
        ({"opt": "sgd-nesterov", "momentum": 0.0}, "--opt sgd-nesterov"),
        ({"norm_weight_decay": -1.0}, "--norm-weight-decay"),
        ({"lr_scheduler": "poly"}, "--lr-scheduler"),
        ({"lr_scheduler": "multistep"}, "--lr-milestones"),
        ({"lr_milestones": (20, 10)}, "--lr-milestones"),
        ({"lr_gamma": 0.0}, "--lr-gamma"),
        ({"lr_step_size": 0}, "--lr-step-size"),
        ({"lr_scheduler": "cosine", "epochs": 5, "lr_warmup_epochs": 5}, "--lr-warmup-epochs"),
        ({"lr_warmup_decay": 0.0}, "--lr-warmup-decay"),
        ({"lr_base": 0.0}, "--lr-base"),
        ({"lr_base_batch": 0}, "--lr-base-batch"),
        ({"model_ema_decay": 1.5}, "--model-ema-decay"),
        ({"model_ema_steps": 0}, "--model-ema-steps"),
    ],
)
def test_bad_recipe_values_name_their_flag(overrides, flag):
    with pytest.raises(UserError, match=flag):
        Config(**overrides)


def test_empty_paths():
    # --resume "" is none, as the classic example's `if args.resume:` reads it (a script's
    # --resume "$CKPT" with CKPT unset); an empty --out-dir or DATA would be the current
    # directory, unsaid.
    assert parse(["train", "--resume", ""])[1][0].checkpoint.resume is None
    assert parse(["train", "--resume", "auto"])[1][0].checkpoint.resume == "auto"
    for args, flag in ((["train", "--out-dir", ""], "--out-dir"), (["train", " "], "DATA")):
        with pytest.raises(UserError, match=f"^{flag}: the path is empty$"):
            parse(args)


def test_the_recipe_flags_parse():
    _, (c, _) = parse(
        [
            "train",
            "--crop-scale",
            "0.25",
            "1",
            "--hflip",
            "0",
            "--auto-augment",
            "ra",
            "--lr-scheduler",
            "multistep",
            "--lr-milestones",
            "30",
            "60",
            "--model-ema",
            "--val-resize",
            "40",
        ]
    )
    assert (c.data.crop_scale, c.data.hflip, c.data.auto_augment) == ((0.25, 1.0), 0.0, "ra")
    assert (c.optim.lr_milestones, c.optim.model_ema, c.data.val_resize) == ((30, 60), True, 40)
    assert parse(["train", "--model-ema", "--no-model-ema"])[1][0].optim.model_ema is False


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--ddp-comm-hook", "bf16"], "--ddp-comm-hook"),
        (["--bucket-cap-mb", "50"], "--bucket-cap-mb"),
        (["--static-graph"], "--static-graph"),
    ],
)
def test_ddp_communication_flags_are_refused_under_fsdp(flags, named):
    with pytest.raises(UserError, match=f"{named} goes with --strategy ddp"):
        parse(["train", "--strategy", "fsdp", *flags])
    _, (config, _) = parse(["train", *flags])  # and taken under ddp
    assert config.parallel.strategy == "ddp"


def test_powersgd_with_a_static_graph_or_fp16_is_refused():
    with pytest.raises(UserError, match="--static-graph"):
        parse(["train", "--ddp-comm-hook", "powersgd", "--static-graph"])
    with pytest.raises(UserError, match="powersgd with --amp fp16"):
        parse(["train", "--ddp-comm-hook", "powersgd", "--amp", "fp16"])


@pytest.mark.parametrize(
    "flags", [["--lr", "nan"], ["--dist-timeout", "inf"], ["--crop-scale", "0.1", "nan"]]
)
def test_a_number_that_is_not_finite_is_refused(flags):
    with pytest.raises(UserError, match=f"{flags[0]} must be a finite number, got"):
        parse(["train", *flags])


def test_the_early_batch_check_waits_for_a_checkpoints_own_batch():
    """Resumed without -b, the checkpoint's -b is the one to divide (checked once merged):
    the default 256 refused a run trained with -b 6 on 3 ranks."""
    check_batch_divides_early(Config(resume="auto"), Layers(), 3)
    with pytest.raises(UserError, match="--batch-size 256"):
        check_batch_divides_early(Config(), Layers(), 3)
    given = Layers(given=frozenset({"batch_size", "accum_steps"}))
    with pytest.raises(UserError, match="--batch-size 256"):
        check_batch_divides_early(Config(resume="auto"), given, 3)
