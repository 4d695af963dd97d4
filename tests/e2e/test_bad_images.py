"""Bad images: `ddptrain check` lists them, --verify-images stops before training, and
--bad-images skip trains without them, resumed mid-epoch bitwise equal to an uninterrupted run.

The data: the tiny set with a corrupt train image and a truncated val image, so 23 train images
(2 steps of 8 an epoch) and 14 val images.
"""

import shutil

import pytest
from cli import (
    assert_same_training,
    ddptrain,
    ok,
    tiny_args,
    torchrun,
    training_state,
    val_records,
)
from test_user_errors import assert_user_error

CORRUPT, TRUNCATED = "train/bar/00003.png", "val/circle/00001.png"


@pytest.fixture(scope="module")
def bad_data(tiny_data, tmp_path_factory):
    data = shutil.copytree(tiny_data, tmp_path_factory.mktemp("bad") / "data")
    (data / CORRUPT).write_bytes(b"not an image at all")
    (data / TRUNCATED).write_bytes((data / TRUNCATED).read_bytes()[:200])
    return data


def error_lines(result, torchrun=False) -> list[str]:
    if not torchrun:  # whose report of a failed worker is a traceback of its own
        assert "Traceback" not in result.stderr, result.stderr
    return [line for line in result.stderr.splitlines() if line.startswith("ddptrain: error:")]


def test_check_lists_every_bad_image_and_exits_2(bad_data, tiny_data):
    result = ddptrain("check", bad_data, "-j", 2)
    assert result.returncode == 2, result.stderr
    assert result.stdout.splitlines() == [
        f"{bad_data / CORRUPT}: not an image in a format TorchCodec or PIL reads",
        f"{bad_data / TRUNCATED}: image file is truncated",
    ]
    assert error_lines(result) == [
        f"ddptrain: error: 2 of 39 images in {bad_data} are bad (1 of 24 train, 1 of 15 val), "
        "listed above: fix or remove them, or train with --bad-images skip"
    ]
    good = ok(ddptrain("check", tiny_data))
    assert good.stdout == f"all 39 images in {tiny_data} decode (24 train, 15 val)\n"


def test_check_refuses_a_decompression_bomb_by_its_header(bad_data):
    result = ddptrain("check", bad_data, "--max-image-pixels", 24 * 24 - 1)
    assert result.returncode == 2
    assert "its header declares 24 x 24 = 576 pixels, more than --max-image-pixels 575" in (
        result.stdout
    )


def test_verify_images_stops_every_rank_before_training(bad_data, tmp_path):
    result = torchrun(2, "train", *tiny_args(bad_data, tmp_path), "--verify-images")
    assert result.returncode != 0
    errors = error_lines(result, torchrun=True)
    assert len(errors) == 2 and errors[0] == errors[1]  # each rank, the same line
    assert "--verify-images: 2 of 39 images in " in errors[0]
    assert f"bad image {bad_data / CORRUPT}: not an image" in result.stderr
    assert not (tmp_path / "checkpoint.pt").exists() and "training resnet18" not in result.stdout


def skip_args(data, out):
    return (
        *("train", *tiny_args(data, out), "--bad-images", "skip", "--resume", "auto"),
        *("--epochs", 2, "--checkpoint-every", 1),
    )


def test_skip_trains_on_the_good_images_and_resumes_mid_epoch_bitwise(bad_data, tmp_path):
    straight, out, marker = tmp_path / "straight", tmp_path / "run", tmp_path / "killed"
    result = ok(torchrun(2, *skip_args(bad_data, straight)))
    assert "2 bad images left out (1 of 24 train, 1 of 15 val)" in result.stdout
    assert training_state(straight)["global_step"] == 4  # 23 images: 2 steps of 8 an epoch
    assert [r["samples"] for r in val_records(straight)] == [14, 14]  # the good val images
    # Resumed without the flag: one line, not "trained on 23 train images, and DATA has 24".
    forgot = ddptrain("train", *tiny_args(bad_data, straight), "--resume", "auto", "--epochs", 3)
    assert_user_error(forgot, "was trained with --bad-images skip: give it again")
    # Without DATA, the checkpoint's DATA is checked: before, nothing was, and the 24 files
    # listed against the 23 trained on stopped the run as changed data.
    further = shutil.copytree(straight, tmp_path / "further")
    no_data = tiny_args(bad_data, further)[1:]
    on = ok(ddptrain("train", *no_data, "--resume", "auto", "--epochs", 3, "--bad-images", "skip"))
    assert "2 bad images left out (1 of 24 train, 1 of 15 val)" in on.stdout
    assert training_state(further)["global_step"] == 6

    # Rank 1 dies before step 4; the restart resumes from step 3, mid-epoch 2.
    kill = {"DDPTRAIN_TEST_KILL": "between:1:4", "DDPTRAIN_TEST_KILL_ONCE": str(marker)}
    resumed = ok(torchrun(2, *skip_args(bad_data, out), env=kill, restarts=1))
    assert marker.exists(), "the fault never fired"
    assert f"resumed from {out}/checkpoint-000000003.pt (epoch 1, step 1 of the next" in (
        resumed.stdout
    )
    assert_same_training(straight, out)


def test_an_image_in_no_class_folder_is_named_at_start_and_left_out(tiny_data, tmp_path):
    data = shutil.copytree(tiny_data, tmp_path / "data")
    shutil.copy(data / "val" / "bar" / "00001.png", data / "val" / "stray.png")
    result = ok(ddptrain("train", *tiny_args(data, tmp_path / "run")))
    assert (
        f"warning: {data / 'val'}: 1 image file(s) in no class folder, left out (first: "
        "stray.png); move each into the folder of its class\n"
    ) in result.stderr
    assert [r["samples"] for r in val_records(tmp_path / "run")] == [15]
