"""Config files through the real CLI: a run's config.json reproduces it, recipes run."""

import json

from cli import assert_same_training, ddptrain, ok, tiny_args
from cli import training_state as state

RECIPE_FLAGS = (
    "--crop-scale",
    "0.5",
    "1",
    "--hflip",
    "0",
    "--auto-augment",
    "ta_wide",
    "--opt",
    "sgd-nesterov",
    "--norm-weight-decay",
    "0",
    "--lr-scheduler",
    "cosine",
    "--epochs",
    "2",
)


def test_a_run_from_its_config_json_reproduces_it(tiny_data, tmp_path):
    first, again = tmp_path / "first", tmp_path / "again"
    ok(ddptrain("train", *tiny_args(tiny_data, first), *RECIPE_FLAGS))
    config = json.loads((first / "config.json").read_text())
    assert config["resolved"]["world_size"] == 1 and config["crop_scale"] == [0.5, 1.0]
    # DATA, the seed and every setting come from the file; where to write from the flag
    ok(ddptrain("train", "--config", first / "config.json", "--out-dir", again, "-j", "0"))
    assert_same_training(first, again)


def test_a_shipped_recipe_runs_and_flags_win(tiny_data, tmp_path):
    result = ok(
        ddptrain(
            "train",
            *tiny_args(tiny_data, tmp_path),
            "--config",
            "recipe:small-images",
            "--lr-warmup-epochs",
            "0",
            "--ra-magnitude",
            "5",
        )
    )
    # The flag that acts on nothing is named; the recipe's --lr-warmup-decay, idle now, is not.
    idle = [line for line in result.stderr.splitlines() if "does nothing in this run" in line]
    assert idle == [
        "warning: --ra-magnitude does nothing in this run: it acts only with --auto-augment ra"
    ]
    saved = state(tmp_path)["config"]
    assert (saved["hflip"], saved["auto_augment"], saved["lr_warmup_epochs"]) == (
        0.0,
        "none",
        0.0,
    )
    assert saved["image_size"] == 16 and saved["lr_base"] == 0.2
