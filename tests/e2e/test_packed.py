"""`ddptrain pack`, then training on the packed set: the folder's weights bitwise, a mid-epoch
resume bitwise, the image check and --bad-images skip, and a bad set named on every rank.

The set: the tiny data in shards of about 20 kB, 4 train and 2 val shards (conftest's
tiny_packed), so that batches and val shards cross shards.
"""

import shutil
import signal

import pytest
from cli import (
    assert_same_training,
    ddptrain,
    env_with,
    ok,
    tiny_args,
    torchrun,
    training_state,
    val_records,
)
from test_user_errors import assert_user_error

from ddptrain.data.pack import pack
from ddptrain.data.sources import source_at


@pytest.fixture(scope="module")
def packed_run(tiny_data, tmp_path_factory):
    """`ddptrain pack` of the tiny data, and a run of tiny_args on it: (set, run, pack's
    output)."""
    root = tmp_path_factory.mktemp("packed-cli")
    packed = ok(ddptrain("pack", tiny_data, root / "set", "--shard-size", 0.02, "-j", 2))
    ok(ddptrain("train", *tiny_args(root / "set", root / "run")))
    return root / "set", root / "run", packed


def test_a_packed_set_trains_to_the_weights_of_its_folder(packed_run, one_rank_run, tiny_data):
    packed, run, result = packed_run
    assert (
        result.stdout == f"packed 24 train, 15 val images of 3 classes into 6 shards in {packed}\n"
    )
    assert "packing train: 24/24 img (100%)" in result.stderr  # plain lines off a terminal
    assert_same_training(one_rank_run, run)  # the same tiny_args on tiny_data
    assert [r["samples"] for r in val_records(run)] == [15]
    again = ddptrain("pack", tiny_data, packed)
    assert_user_error(again, f"OUT: {packed} holds a packed set already", "--overwrite")


def test_a_packed_set_resumes_mid_epoch_bitwise(tiny_packed, tmp_path):
    straight, out = tmp_path / "straight", tmp_path / "run"
    run = ("--epochs", 2, "--checkpoint-every", 1)
    ok(ddptrain("train", *tiny_args(tiny_packed, straight), *run))
    # Loader workers on the resumed side: each opens its own shard handles.
    killed = ddptrain(
        "train",
        *tiny_args(tiny_packed, out),
        *run,
        "-j",
        2,
        env=env_with(DDPTRAIN_TEST_KILL="between:0:6"),
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr  # mid-epoch 2, after step 5
    ok(ddptrain("train", *tiny_args(tiny_packed, out), *run, "-j", 2, "--resume", "auto"))
    assert_same_training(straight, out)


CORRUPT, TRUNCATED = "train/bar/00003.png", "val/circle/00001.png"


@pytest.fixture(scope="module")
def bad_packed(tiny_data, tmp_path_factory):
    """The tiny data with a corrupt train image and a truncated val image, packed."""
    root = tmp_path_factory.mktemp("bad-packed")
    data = shutil.copytree(tiny_data, root / "data")
    (data / CORRUPT).write_bytes(b"not an image at all")
    (data / TRUNCATED).write_bytes((data / TRUNCATED).read_bytes()[:200])
    pack(str(data), str(root / "set"), shard_size=0.02, workers=0)
    return root / "set"


def test_check_names_each_bad_image_with_its_shard(bad_packed):
    result = ddptrain("check", bad_packed, "-j", 2)
    assert result.returncode == 2, result.stderr
    source = source_at(bad_packed)
    assert result.stdout.splitlines() == [
        f"{source.shown(CORRUPT)}: not an image in a format TorchCodec or PIL reads",
        f"{source.shown(TRUNCATED)}: image file is truncated",
    ]
    assert f"{bad_packed}/train/0000" in source.shown(CORRUPT)
    assert_user_error(result, f"2 of 39 images in {bad_packed} are bad (1 of 24 train")


def test_a_bad_image_stops_training_in_one_line_and_skip_trains_without_it(bad_packed, tmp_path):
    stopped = ddptrain("train", *tiny_args(bad_packed, tmp_path / "stopped"), "-j", 2)
    source = source_at(bad_packed)
    assert_user_error(stopped, f"cannot read image {source.shown(CORRUPT)}: not an image")
    skipped = ok(
        torchrun(2, "train", *tiny_args(bad_packed, tmp_path / "run"), "--bad-images", "skip")
    )
    assert "2 bad images left out (1 of 24 train, 1 of 15 val)" in skipped.stdout
    assert training_state(tmp_path / "run")["global_step"] == 2  # 23 images: 2 steps of 8
    assert [r["samples"] for r in val_records(tmp_path / "run")] == [14]


def error_lines(result) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("ddptrain: error:")]


def test_a_truncated_shard_ends_every_rank_in_one_line(tiny_packed, tmp_path):
    packed = shutil.copytree(tiny_packed, tmp_path / "set")
    shard = packed / "train" / "000003.tar"
    shard.write_bytes(shard.read_bytes()[:-4096])
    result = torchrun(2, "train", *tiny_args(packed, tmp_path / "run"))
    assert result.returncode != 0
    errors = error_lines(result)
    assert len(errors) == 2 and errors[0] == errors[1]
    assert f"DATA: shard {shard} has 6144 bytes, and {packed}/index.json says 10240" in errors[0]
    assert not (tmp_path / "run" / "checkpoint.pt").exists()


def test_a_label_out_of_range_in_the_index_is_named(tiny_packed, tmp_path):
    packed = shutil.copytree(tiny_packed, tmp_path / "set")
    index = packed / "index.json"
    index.write_text(
        index.read_text().replace('"arrow/00000.png",512,550,0]', '"arrow/00000.png",512,550,7]')
    )
    result = ddptrain("train", *tiny_args(packed, tmp_path / "run"))
    assert_user_error(
        result, f"DATA: {index}: train/000000.tar, sample 0 (arrow/00000.png): label 7"
    )


def test_resuming_on_a_set_packed_again_names_the_changed_shard(packed_run, tiny_data, tmp_path):
    packed, run, _ = packed_run
    again, out = shutil.copytree(packed, tmp_path / "set"), shutil.copytree(run, tmp_path / "run")
    pack(str(tiny_data), str(again), shard_size=0.03, workers=0, overwrite=True)
    result = ddptrain("train", *tiny_args(again, out), "--epochs", 2, "--resume", "auto")
    assert_user_error(result, "shard val/000000.tar changed since", "(it had 20480 bytes and has")


def test_a_packed_table_set_trains_to_the_weights_of_the_table_and_its_folder(
    tiny_parquet, tiny_packed, one_rank_run, tmp_path
):
    packed = tmp_path / "set"
    result = ok(ddptrain("pack", tiny_parquet, packed, "--shard-size", 0.02, "-j", 2))
    assert (
        result.stdout == f"packed 24 train, 15 val images of 3 classes into 6 shards in {packed}\n"
    )
    # The rows hold the folder's files in its order: the shards are the folder's, byte for byte
    # (members named by the images' format, .png), the rows named as a table names them.
    for shard in sorted(tiny_packed.rglob("*.tar")):
        assert (packed / shard.relative_to(tiny_packed)).read_bytes() == shard.read_bytes()
    names = source_at(packed).index.splits["train"].names
    assert (names[0], names[9], names[10]) == (
        "part-0.parquet:0",
        "part-0.parquet:9",
        "part-1.parquet:0",
    )
    ok(ddptrain("train", *tiny_args(packed, tmp_path / "run")))
    assert_same_training(one_rank_run, tmp_path / "run")  # the table's weights are the folder's
