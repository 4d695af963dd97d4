"""Inputs a careless user or an attacker hands the CLI: each ends in one line, on every rank, and
leaves nothing behind; what can be read is read (the first frame of a file of several)."""

import csv
import io
import shutil
from pathlib import Path

from cli import ddptrain, ok, tcp_pair, tiny_args
from PIL import Image
from test_user_errors import assert_user_error

HEIC = Path(__file__).parents[1] / "unit" / "images"  # see tests/unit/test_image_guards.py


def test_a_password_in_a_data_url_is_refused_on_every_rank_and_recorded_nowhere(tmp_path):
    # Two invocations meeting at tcp://: no launcher ends one when the other fails first.
    url = "http://ann:hunter2@127.0.0.1:9/set"
    ranks = tcp_pair("train", *tiny_args(url, tmp_path / "run"))
    for rank in ranks:
        assert_user_error(rank, "DATA http://***@127.0.0.1:9/set holds a user name or password")
        assert rank.returncode == 2 and len(rank.stderr.strip().splitlines()) == 1, rank.stderr
        assert "hunter2" not in rank.stdout + rank.stderr
    assert not (tmp_path / "run").exists()


def test_check_bounds_a_heic_under_any_name(tmp_path):
    data = tmp_path / "data"
    for split in ("train", "val"):
        (data / split / "cat").mkdir(parents=True)
        Image.new("RGB", (8, 8)).save(data / split / "cat" / "small.png")
    shutil.copy(HEIC / "one.heic", data / "train" / "cat" / "x.jpg")  # 64 x 64 coded
    result = ddptrain("check", data, "-j", 0, "--max-image-pixels", 1000)
    assert result.stdout.splitlines() == [
        f"{data}/train/cat/x.jpg: its header declares 64 x 64 = 4,096 pixels, more than "
        "--max-image-pixels 1,000 (a decompression bomb, or raise the limit)"
    ]
    assert_user_error(result, "1 of 3 images in")


def test_predict_reads_the_first_frame_of_files_of_several(one_rank_run, tmp_path):
    frames = [Image.new("RGB", (20, 20), colour) for colour in ("red", "green", "blue")]
    animated = io.BytesIO()
    frames[0].save(animated, "AVIF", save_all=True, append_images=frames[1:])
    (tmp_path / "anim.jpg").write_bytes(animated.getvalue())
    shutil.copy(HEIC / "three.heic", tmp_path / "three.jpg")
    out = tmp_path / "p.csv"
    args = (one_rank_run / "model_best.pt", tmp_path / "anim.jpg", tmp_path / "three.jpg")
    ok(ddptrain("predict", *args, "--out", out, "-j", 1, "--bad-images", "error"))
    rows = list(csv.DictReader(out.read_text().splitlines()))
    assert [row["path"] for row in rows] == [str(tmp_path / n) for n in ("anim.jpg", "three.jpg")]
    assert all(row["top1"] and "error" not in row for row in rows)
