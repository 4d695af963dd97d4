import csv
import json
import os
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from ddptrain.errors import UserError
from ddptrain.tools import prediction_files
from ddptrain.tools.predict import _topk, list_inputs

ROWS = [
    {"path": "a.png", "top1": "cat", "prob1": 0.75, "top2": "dog", "prob2": 0.25},
    {"path": "b.png", "error": "not an image"},
]


def test_folders_are_walked_in_sorted_order_and_files_taken_as_given(tmp_path):
    for name in ("b/2.png", "b/10.jpg", "a/z.png", "a.png", "b/.hidden.png", ".cache/x.png"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"")
    (tmp_path / "notes.txt").write_text("")
    (tmp_path / "b" / "loop").symlink_to(tmp_path / "b")  # listed once
    listed = list_inputs([str(tmp_path), str(tmp_path / "notes.txt")]).paths
    below = [p[len(str(tmp_path)) + 1 :] for p in listed]
    assert below == ["a/z.png", "a.png", "b/10.jpg", "b/2.png", "notes.txt"]


def test_missing_inputs_and_empty_folders_are_named(tmp_path):
    with pytest.raises(UserError, match=r"INPUT .*nothing does not exist"):
        list_inputs([str(tmp_path / "nothing")])
    with pytest.raises(UserError, match=r"INPUT .* holds no image files"):
        list_inputs([str(tmp_path)])


def test_topk_defaults_to_5_or_every_class():
    assert (_topk(None, 1000), _topk(None, 3), _topk(2, 3)) == (5, 3, 2)
    with pytest.raises(UserError, match="--topk 4: the model has 3 classes"):
        _topk(4, 3)


@pytest.mark.parametrize("suffix", [".csv", ".jsonl", ".parquet"])
def test_each_format_has_the_columns_in_order(tmp_path, suffix):
    out = tmp_path / f"p{suffix}"
    prediction_files.check(out)
    prediction_files.write(out, ROWS, 2)
    if suffix == ".csv":
        with open(out, newline="") as f:
            rows = list(csv.reader(f))
        assert rows == [
            ["path", "top1", "prob1", "top2", "prob2", "error"],
            ["a.png", "cat", "0.75", "dog", "0.25", ""],
            ["b.png", "", "", "", "", "not an image"],
        ]
        return
    if suffix == ".jsonl":
        rows = [json.loads(line) for line in out.read_text().splitlines()]
    else:
        rows = pq.read_table(out).to_pylist()
    assert [list(row) for row in rows] == [prediction_files.columns(ROWS, 2)] * 2
    assert rows[0] == {**ROWS[0], "error": None}
    assert rows[1] == {"path": "b.png", "error": "not an image"} | {
        name: None for name in ("top1", "prob1", "top2", "prob2")
    }


@pytest.mark.parametrize("suffix", [".csv", ".jsonl", ".parquet"])
def test_a_file_name_that_is_not_utf8_is_written_in_every_format(tmp_path, suffix):
    name = b"caf\xe9.png".decode(errors="surrogateescape")  # as os.listdir gives it
    rows = [{"path": name, "top1": name, "prob1": 1.0}, {"path": name, "error": f"{name}: bad"}]
    out = tmp_path / f"p{suffix}"
    prediction_files.write(out, rows, 1)
    if suffix == ".csv":
        assert b"caf\xe9.png,caf\xe9.png,1.0" in out.read_bytes()
    elif suffix == ".jsonl":
        assert json.loads(out.read_text().splitlines()[0])["path"] == name
    else:  # Parquet holds UTF-8 only: the byte is written escaped
        rows = pq.read_table(out).to_pylist()
        assert rows[0]["path"] == rows[0]["top1"] == "caf\\xe9.png"
        assert rows[1]["error"] == "caf\\xe9.png: bad"


def test_no_error_column_when_every_image_was_read():
    assert prediction_files.columns(ROWS[:1], 2) == ["path", "top1", "prob1", "top2", "prob2"]


def test_an_out_of_another_kind_is_refused_before_any_work(tmp_path):
    with pytest.raises(UserError, match=r"--out .*p.txt must end in .csv, .jsonl, .parquet"):
        prediction_files.check(tmp_path / "p.txt")
    with pytest.raises(UserError, match=r"no directory"):
        prediction_files.check(tmp_path / "no" / "p.csv")


def unwritable_directory(tmp_path) -> Path:
    """A directory this process cannot create files in: one without write permission, or, for
    root, whom permissions do not stop, sysfs, which takes no new files from anyone."""
    if os.geteuid() == 0:
        return Path("/sys")
    (tmp_path / "read-only").mkdir(mode=0o555)
    return tmp_path / "read-only"


def test_an_out_that_could_not_be_written_is_refused_before_any_work(tmp_path):
    (tmp_path / "p.csv").mkdir()
    with pytest.raises(UserError, match=rf"^predict: --out {tmp_path}/p.csv is a directory;"):
        prediction_files.check(tmp_path / "p.csv")
    blocked = unwritable_directory(tmp_path)
    with pytest.raises(UserError, match=rf"^predict: --out {blocked}/p.csv: cannot write in "):
        prediction_files.check(blocked / "p.csv")
    before = sorted(tmp_path.iterdir())
    prediction_files.check(tmp_path / "q.csv")
    assert sorted(tmp_path.iterdir()) == before  # the check leaves nothing behind
