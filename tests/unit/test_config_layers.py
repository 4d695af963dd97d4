"""One precedence chain: defaults < checkpoint config < --config FILE < flags; config files,
recipes, and config.json fed back."""

import json

import pytest
import torch
from torch import nn

from ddptrain.cli import parse
from ddptrain.config import _ACTS_ONLY_WITH, Config, inert_flags, settings
from ddptrain.config_layers import Layers, Unsettled, merge, read, recipes, resumed, settled
from ddptrain.errors import UserError
from ddptrain.model.precision import resolve_precision
from ddptrain.state.resume import kept_seed


def write(tmp_path, text, name="run.toml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_argparse_leaves_out_what_was_not_given():
    _, (c, layers) = parse(["train"])
    assert c == Config() and layers.given == frozenset()
    _, (c, layers) = parse(
        ["train", "/d", "--lr", "0.1", "-b", "256"]
    )  # defaults, given explicitly
    assert layers.given == {"data", "lr", "batch_size"}


def test_each_layer_wins_over_the_one_below(tmp_path):
    file = write(tmp_path, 'epochs = 5\nlr = 0.3\nauto-augment = "ta_wide"\n')
    _, (c, layers) = parse(["train", "--config", file, "--lr", "0.2"])
    assert (c.optim.epochs, c.optim.lr, c.data.auto_augment, c.optim.batch_size) == (
        5,
        0.2,
        "ta_wide",
        256,
    )
    saved = {**Config(epochs=9, lr=0.7, momentum=0.5, amp="bf16").to_dict(), "batch_size": 64}
    r = resumed(c, layers, saved)
    # flags and the file beat the checkpoint; the checkpoint beats the defaults
    assert (r.optim.epochs, r.optim.lr, r.data.auto_augment) == (5, 0.2, "ta_wide")
    assert (r.optim.momentum, r.model.amp, r.optim.batch_size) == (0.5, "bf16", 64)
    given = {name: c.to_dict()[name] for name in layers.given}
    assert {name: r.to_dict()[name] for name in layers.given} == given


def test_an_explicit_default_beats_the_checkpoint():
    _, (c, layers) = parse(["train", "--amp", "none", "--channels-last"])
    r = resumed(c, layers, Config(amp="bf16", channels_last=False, compile=True).to_dict())
    assert (r.model.amp, r.model.channels_last, r.model.compile) == ("none", True, True)
    _, (c, layers) = parse(["train"])
    assert resumed(c, layers, None) is c


def test_a_checkpoint_never_says_where_or_how_to_run():
    saved = Config(
        resume="auto",
        out_dir="/elsewhere",
        workers=16,
        world_size=8,
        rank=3,
        multiprocessing_distributed=True,
        device="cuda",
        epochs=12,
    ).to_dict()
    r = resumed(Config(), Layers(), {**saved, "a_key_from_another_version": 1})
    assert r.optim.epochs == 12
    assert (
        r.checkpoint.resume,
        r.checkpoint.out_dir,
        r.data.workers,
        r.launch.world_size,
        r.launch.rank,
    ) == (None, ".", 4, -1, -1)
    assert (r.launch.multiprocessing_distributed, r.launch.device) == (False, "auto")


def test_lr_and_lr_base_are_one_setting(tmp_path):
    with pytest.raises(UserError, match="--lr and --lr-base"):
        parse(["train", "--lr", "0.1", "--lr-base", "0.1"])
    file = write(tmp_path, "lr = 0.5\n")
    _, (c, _) = parse(["train", "--config", file, "--lr-base", "0.2"])
    assert c.optim.lr_base == 0.2 and c.optim.lr == Config().optim.lr
    file = write(tmp_path, "lr-base = 0.2\n")
    _, (c, _) = parse(["train", "--config", file, "--lr", "0.05"])
    assert c.optim.lr == 0.05 and c.optim.lr_base is None
    # a checkpoint that scaled its LR keeps doing so, unless --lr is given
    saved = Config(lr_base=0.4, batch_size=512).to_dict()
    assert resumed(*parse(["train"])[1], saved).optim.lr_base == 0.4
    r = resumed(*parse(["train", "--lr", "0.01"])[1], saved)
    assert (r.optim.lr, r.optim.lr_base) == (0.01, None)
    both = write(tmp_path, "lr = 0.1\nlr-base = 0.1\n")
    with pytest.raises(UserError, match=f"--config {both}: --lr and --lr-base"):
        parse(["train", "--config", both])


def test_keys_are_long_flag_names_with_dashes_or_underscores(tmp_path):
    file = write(
        tmp_path,
        "learning-rate = 0.3\nwd = 0.01\nbatch_size = 64\nlr-milestones = [3, 6]\n"
        'crop-scale = [0.25, 1]\nlr_scheduler = "multistep"\nmodel-ema = true\n',
    )
    assert read(file) == {
        "lr": 0.3,
        "weight_decay": 0.01,
        "batch_size": 64,
        "lr_milestones": (3, 6),
        "crop_scale": (0.25, 1.0),
        "lr_scheduler": "multistep",
        "model_ema": True,
    }


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("learning_rat = 0.1\n", "unknown key 'learning_rat'"),
        ("[optim]\nlr = 0.1\n", "unknown key 'optim'"),
        ('lr = "fast"\n', "lr must be a number, got 'fast'"),
        ("epochs = 1.5\n", "epochs must be an integer, got 1.5"),
        ("model-ema = 1\n", "model-ema must be true or false, got 1"),
        ("crop-scale = [0.5]\n", "crop-scale must be a list of 2 values"),
        ('lr-milestones = [1, "x"]\n', "lr-milestones must be a list of one or more values"),
        ("lr = 0.1\nlearning-rate = 0.2\n", "'learning-rate' sets --lr a second time"),
        ("lr = \n", "not valid TOML"),
    ],
)
def test_mistakes_in_a_file_name_the_key_and_the_file(tmp_path, text, message):
    file = write(tmp_path, text)
    with pytest.raises(UserError, match=message) as caught:
        parse(["train", "--config", file])
    assert str(caught.value).startswith(f"--config {file}: ")


def test_values_a_file_gives_are_checked_like_flags_and_name_the_file(tmp_path):
    file = write(tmp_path, "hflip = 2.0\n")
    with pytest.raises(UserError, match=f"^--config {file}: --hflip must be between"):
        parse(["train", "--config", file])
    file = write(tmp_path, 'opt = "lamb"\n')
    with pytest.raises(UserError, match=f"^--config {file}: --opt must be one of"):
        parse(["train", "--config", file])
    file = write(tmp_path, 'arch = "resnet9000"\n')
    with pytest.raises(UserError, match=f"^--config {file}: --arch: unknown"):
        parse(["train", "--config", file])
    # The flag given on the command line is the one at fault, not the file's.
    with pytest.raises(UserError, match="^--hflip must be between"):
        parse(["train", "--config", write(tmp_path, "hflip = 0.5\n"), "--hflip", "3"])
    file = write(tmp_path, 'opt = "sgd-nesterov"\n')
    with pytest.raises(UserError, match="^--opt sgd-nesterov needs --momentum"):
        parse(["train", "--config", file, "--momentum", "0"])  # the two share the fault


def test_missing_file_and_unknown_recipe(tmp_path):
    with pytest.raises(UserError, match="nope.toml: cannot read it"):
        parse(["train", "--config", str(tmp_path / "nope.toml")])
    with pytest.raises(UserError, match="no such recipe; shipped: classic, "):
        parse(["train", "--config", "recipe:fancy"])


def test_config_json_feeds_back_without_resolved_or_invocation_settings(tmp_path):
    record = Config(
        data="/data", epochs=3, lr_base=0.2, hflip=0.0, crop_scale=(0.3, 1.0), out_dir="runs/a"
    )
    saved = {**record.to_dict(), "resolved": {"world_size": 2, "per_rank_batch": 128}}
    file = write(tmp_path, json.dumps(saved), "config.json")
    _, (c, _) = parse(["train", "--config", file, "--out-dir", "runs/b"])
    assert (c.data.root, c.optim.epochs, c.optim.lr_base, c.data.hflip, c.data.crop_scale) == (
        "/data",
        3,
        0.2,
        0.0,
        (0.3, 1),
    )
    assert c.checkpoint.out_dir == "runs/b"
    assert c.to_dict() == {**record.to_dict(), "out_dir": "runs/b"}
    with pytest.raises(UserError, match="unknown key 'surprise'"):
        read(write(tmp_path, json.dumps({**saved, "surprise": 1}), "config.json"))


def test_shipped_recipes_parse_and_classic_is_the_defaults():
    assert recipes() == ["classic", "finetune", "resnet50-torchvision", "small-images"]
    _, (classic, _) = parse(["train", "/data", "--config", "recipe:classic"])
    assert classic == Config(data="/data")
    _, (r50, _) = parse(["train", "/data", "--config", "recipe:resnet50-torchvision"])
    assert (
        r50.model.arch,
        r50.optim.batch_size,
        r50.optim.lr,
        r50.optim.epochs,
        r50.data.image_size,
    ) == (
        "resnet50",
        1024,
        0.5,
        600,
        176,
    )
    assert (
        r50.data.val_resize,
        r50.data.val_crop,
        r50.optim.model_ema,
        r50.optim.lr_scheduler,
    ) == (
        232,
        224,
        True,
        "cosine",
    )
    _, (small, _) = parse(["train", "--config", "recipe:small-images", "--epochs", "10"])
    assert small.data.hflip == 0.0 and small.optim.lr_base is not None and small.optim.model_ema


def test_eval_shares_the_flags_and_the_files(tmp_path):
    file = write(tmp_path, "image-size = 64\n")
    _, (c, _) = parse(["eval", "/d", "--resume", "ckpt.pt", "--config", file, "--val-crop", "60"])
    assert c.checkpoint.evaluate and (c.data.image_size, c.data.val_crop) == (64, 60)


def test_merge_is_usable_without_the_cli():
    c, _ = merge({"lr": 0.2}, file={"epochs": 3}, saved={"epochs": 7, "momentum": 0.1})
    assert (c.optim.lr, c.optim.epochs, c.optim.momentum) == (0.2, 3, 0.1)


@pytest.mark.parametrize(
    "flags",
    [[], ["--amp", "none"], ["--no-channels-last"], ["--compile", "--amp", "bf16"]],
)
@pytest.mark.parametrize(
    "saved",
    [
        None,
        {"amp": "bf16", "channels_last": False, "compile": True},
        {"amp": "none", "channels_last": True, "compile": False},
    ],
)
def test_the_checkpoint_layer_replaces_resolve_precisions_own_fallback(flags, saved):
    """resolve_precision(config, saved) looks up the checkpoint itself; after `resumed` the
    config already holds the checkpoint's settings, and resolve_precision(config, None) agrees."""
    convnet = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten())
    cpu = torch.device("cpu")
    _, (config, layers) = parse(["train", *flags])
    saved_config = None if saved is None else {**Config().to_dict(), **saved}

    def settings_of(config, saved_config):
        size, seeded = config.data.image_size, config.optim.seed is not None
        resolved = resolve_precision(
            config.model, saved_config, convnet, cpu, image_size=size, seeded=seeded
        )
        return resolved.settings()

    today = settings_of(config, saved_config)
    merged = settings_of(resumed(config, layers, saved_config), None)
    assert merged == today


def test_flags_that_act_on_nothing_are_named_once_the_checkpoint_settings_are_in(tmp_path):
    _, (c, layers) = parse(["train", "--opt", "adamw", "--momentum", "0.5", "--lr-min", "0.01"])
    flags = layers.on_command_line
    assert inert_flags(c, flags) == [
        "--momentum does nothing in this run: it acts only with --opt sgd or sgd-nesterov",
        "--lr-min does nothing in this run: it acts only with --lr-scheduler cosine",
    ]
    cosine = {**Config().to_dict(), "lr_scheduler": "cosine"}
    # the run it resumes is cosine
    assert inert_flags(resumed(c, layers, cosine), flags) == [inert_flags(c, flags)[0]]
    file = write(tmp_path, "lr-min = 0.01\nmodel-ema-decay = 0.99\n")  # a file's are not named
    _, (from_file, layers) = parse(["train", "--config", file, "--lr-warmup-decay", "0.1"])
    flags = layers.on_command_line
    assert inert_flags(from_file, flags) == [
        "--lr-warmup-decay does nothing in this run: it acts only with --lr-warmup-epochs above 0"
    ]
    assert inert_flags(resumed(from_file, layers, cosine), flags) == inert_flags(from_file, flags)
    _, (acting, layers) = parse(
        ["train", "--lr-scheduler", "multistep", "--lr-milestones", "2", "--lr-gamma", "0.5"]
    )
    assert inert_flags(acting, layers.on_command_line) == []


def test_the_flags_watched_for_acting_on_nothing_are_settings():
    assert set(_ACTS_ONLY_WITH) <= set(settings())


def test_a_seed_given_on_resume_is_named_where_the_run_keeps_another():
    saved = {"config": Config(seed=0).to_dict(), "data_seed": 0}

    def kept(config, layers):
        return kept_seed(resumed(config, layers, saved["config"]), saved, layers.on_command_line)

    assert kept(*parse(["train", "--seed", "5"])[1]) == (
        "--seed 5 does not reseed a resumed run: it keeps its data seed 0 (sample order, "
        "augmentation) and its random states, to continue exactly"
    )
    # the command that started it, run again
    assert kept(*parse(["train", "--seed", "0"])[1]) is None
    assert kept(*parse(["train"])[1]) is None
    from_file = Layers(given=frozenset({"seed"}))  # as inert_flags: flags alone
    assert kept(Config(seed=5), from_file) is None


def test_settings_checked_against_each_other_wait_for_the_checkpoints():
    """The layers are defaults < checkpoint < file < flags: `--fsdp-offload` resuming an fsdp
    run was refused against the default --strategy ddp, before the checkpoint's was in."""
    flags = ["train", "--resume", "run/checkpoint.pt", "--fsdp-offload", "--val-resize", "20"]
    _, (waiting, layers) = parse(flags)
    assert isinstance(waiting, Unsettled) and list(waiting.to_dict()) == list(settings())
    assert isinstance(waiting.replace(data="/d"), Unsettled)  # run.py's image check takes one
    fsdp_16px = {**Config().to_dict(), "strategy": "fsdp", "image_size": 16}
    merged = resumed(waiting, layers, fsdp_16px)
    assert type(merged) is Config and merged.parallel.fsdp_offload and merged.data.val_resize == 20
    assert settled(merged) is merged
    with pytest.raises(UserError, match="--fsdp-offload goes with --strategy fsdp"):
        resumed(waiting, layers, {**fsdp_16px, "strategy": "ddp"})
    with pytest.raises(UserError, match="--fsdp-offload goes with --strategy fsdp"):
        settled(waiting)  # no checkpoint found (--resume auto): the defaults stay
    with pytest.raises(UserError, match="--fsdp-offload goes with --strategy fsdp"):
        parse(["train", "--fsdp-offload"])  # nothing to wait for
    with pytest.raises(UserError, match="--lr-milestones must rise"):
        parse([*flags, "--lr-milestones", "3", "2"])  # one setting alone: at once
