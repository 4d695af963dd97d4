"""`ddptrain predict` and `ddptrain export --format onnx`, through the real CLI on the tiny
dataset, from one model trained for the module."""

import csv
import json
import os
import shutil

import numpy as np
import onnxruntime
import pyarrow.parquet as pq
import pytest
import torch
import torchvision
from cli import ddptrain, ok, tiny_args, torchrun, val_records
from test_user_errors import assert_user_error

from ddptrain.tools.export import describe

# 1 epoch at a low LR, so the model still tells some classes apart; fp32 throughout, as predict
# runs, so that eval's counts and predict's agree to the image.
TRAIN = ("--lr", "0.01", "--amp", "none", "--model-ema", "--model-ema-steps", "1")


@pytest.fixture(scope="module")
def trained(tiny_data, tmp_path_factory, cache_env):
    out = tmp_path_factory.mktemp("predict") / "run"
    ok(ddptrain("train", *tiny_args(tiny_data, out), *TRAIN, env=cache_env))
    return out


def inputs(tiny_data) -> list[str]:
    """The 15 val images (a folder) and 2 train images (files): 17, uneven over 2 ranks."""
    train = tiny_data / "train"
    return [
        str(tiny_data / "val"),
        str(train / "bar" / "00000.png"),
        str(train / "arrow/00001.png"),
    ]


def read_csv(path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def one_rank(trained, tiny_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("one-rank") / "p.csv"
    result = ok(
        ddptrain(
            "predict", trained / "checkpoint.pt", *inputs(tiny_data), "--out", out, "-b", 4, "-j", 0
        )
    )
    assert f"wrote {out} (17 images, top-3)" in result.stdout
    return read_csv(out)


def test_rows_follow_the_inputs_in_order_each_once(one_rank, tiny_data):
    val = tiny_data / "val"
    expected = [
        str(val / name / f"{i:05d}.png") for name in ("arrow", "bar", "circle") for i in range(5)
    ]
    assert [row["path"] for row in one_rank] == expected + inputs(tiny_data)[1:]
    assert list(one_rank[0]) == ["path", "top1", "prob1", "top2", "prob2", "top3", "prob3"]
    for row in one_rank:
        probs = [float(row[f"prob{k}"]) for k in (1, 2, 3)]
        assert probs == sorted(probs, reverse=True) and sum(probs) == pytest.approx(1, abs=1e-5)
        assert {row["top1"], row["top2"], row["top3"]} == {"arrow", "bar", "circle"}


def test_two_ranks_give_one_ranks_rows(one_rank, trained, tiny_data, tmp_path):
    out = tmp_path / "p.csv"
    # -b 4: 2 per rank; the shards of 17 inputs are 8 and 9, the last batch of one
    args = ("predict", trained / "checkpoint.pt", *inputs(tiny_data), "--out", out, "-b", 4)
    result = ok(torchrun(2, *args, "-j", 0))
    assert result.stdout.count("wrote") == 1  # rank 0 alone
    rows = read_csv(out)
    assert [row["path"] for row in rows] == [row["path"] for row in one_rank]
    for two, one in zip(rows, one_rank, strict=True):
        assert [two[f"top{k}"] for k in (1, 2, 3)] == [one[f"top{k}"] for k in (1, 2, 3)]
        for k in (1, 2, 3):
            assert float(two[f"prob{k}"]) == pytest.approx(float(one[f"prob{k}"]), abs=1e-5)


def correct_share(rows: list[dict]) -> float:
    """acc1 of rows of val images, whose class is their folder's name."""
    val = [row for row in rows if "/val/" in row["path"]]
    assert len(val) == 15
    return 100 * sum(row["top1"] == row["path"].split("/")[-2] for row in val) / len(val)


def test_top1_agrees_with_eval_to_the_image(one_rank, trained, tiny_data, tmp_path):
    common = ("-b", 8, "-j", 0, "--out-dir", tmp_path / "eval")
    ok(ddptrain("eval", tiny_data, "--resume", trained / "checkpoint.pt", *common))
    (evaluated,) = val_records(tmp_path / "eval")
    assert correct_share(one_rank) == pytest.approx(evaluated["acc1"], abs=1e-9)
    # --ema: the average's weights, as training evaluated them (val_ema)
    out = tmp_path / "ema.jsonl"
    ok(ddptrain("predict", trained / "checkpoint.pt", tiny_data / "val", "--out", out, "--ema"))
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    (ema,) = val_records(trained, "val_ema")
    assert correct_share(rows) == pytest.approx(ema["acc1"], abs=1e-9)
    assert rows != [row for row in one_rank if "/val/" in row["path"]]  # other weights


def test_a_bad_image_gets_an_error_or_stops_the_run(trained, tiny_data, tmp_path):
    images = tmp_path / "images"
    shutil.copytree(tiny_data / "val" / "bar", images / "bar")
    (images / "bar" / "broken.png").write_bytes(b"not an image")
    (images / ".hidden.png").write_bytes(b"never listed")
    out = tmp_path / "p.parquet"
    args = ("predict", trained / "checkpoint.pt", images, "-j", 0, "--topk", 1)
    result = ok(ddptrain(*args, "--out", out))
    assert "(6 images, top-1; 1 could not be read" in result.stdout
    rows = pq.read_table(out).to_pylist()
    names = [f"{i:05d}.png" for i in range(5)] + ["broken.png"]  # sorted; not .hidden.png
    assert [row["path"] for row in rows] == [str(images / "bar" / name) for name in names]
    assert all(
        row["error"] is None and row["top1"] in ("arrow", "bar", "circle") for row in rows[:5]
    )
    assert rows[5]["top1"] is None and rows[5]["prob1"] is None and rows[5]["error"]
    stopped = tmp_path / "stopped.csv"
    result = ddptrain(*args, "--out", stopped, "--bad-images", "error")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.startswith(
        f"ddptrain: error: predict: cannot read image {images}/bar/broken.png"
    )
    assert not stopped.exists()


def test_onnx_export_matches_torch_at_any_batch(trained, tmp_path):
    out = tmp_path / "m.onnx"
    result = ok(ddptrain("export", trained / "checkpoint.pt", "--format", "onnx", "--out", out))
    assert f"wrote {out} and {tmp_path / 'm.json'} (resnet18, 3 classes)" in result.stdout
    assert "largest logit difference" in result.stdout
    checkpoint = torch.load(trained / "checkpoint.pt", weights_only=True)
    # the JSON a safetensors export writes
    assert json.loads((tmp_path / "m.json").read_text()) == describe(checkpoint, out)
    model = torchvision.models.resnet18(num_classes=3)
    model.load_state_dict(checkpoint["model"])
    session = onnxruntime.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    for batch in (1, 5):
        images = torch.randn(batch, 3, 16, 16)
        with torch.no_grad():
            expected = model.eval()(images).numpy()
        (logits,) = session.run(None, {"input": images.numpy()})
        assert np.abs(logits - expected).max() <= 1e-4


def test_onnx_export_without_the_runtime_says_what_to_install(trained, tmp_path):
    absent = tmp_path / "absent"
    (absent / "onnxruntime").mkdir(parents=True)
    # what Python finds where onnxruntime is not installed
    (absent / "onnxruntime" / "__init__.py").write_text(
        "raise ModuleNotFoundError('onnxruntime')\n"
    )
    env = {"PYTHONPATH": f"{absent}:{os.environ.get('PYTHONPATH', '')}"}
    out = tmp_path / "m.onnx"
    result = ddptrain(
        "export", trained / "checkpoint.pt", "--format", "onnx", "--out", out, env=env
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr == (
        "ddptrain: error: export --format onnx needs onnx, onnxscript and onnxruntime: "
        "pip install 'ddptrain[onnx]'\n"
    )
    assert not out.exists()


def test_a_table_set_is_predicted_as_its_folder(one_rank, trained, tiny_parquet, tmp_path):
    out = tmp_path / "p.jsonl"
    ok(ddptrain("predict", trained / "checkpoint.pt", tiny_parquet, "--out", out, "-j", 0))
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    # its splits in order, each in the order training reads it: train's two files, then val's
    assert [row["path"] for row in rows] == [
        *(f"{tiny_parquet}/train/part-0.parquet:{i}" for i in range(10)),
        *(f"{tiny_parquet}/train/part-1.parquet:{i}" for i in range(14)),
        *(f"{tiny_parquet}/val/part-0.parquet:{i}" for i in range(15)),
    ]
    # the folder's val images, as bytes in a table: the same classes and probabilities
    for table, files in zip(rows[24:], one_rank[:15], strict=True):
        assert [table[f"top{k}"] for k in (1, 2, 3)] == [files[f"top{k}"] for k in (1, 2, 3)]
        assert table["prob1"] == pytest.approx(float(files["prob1"]), abs=1e-6)


def test_a_packed_set_at_a_url_is_predicted_as_on_the_disk(
    trained, tiny_packed, http_server, tmp_path
):
    url = http_server(tiny_packed)
    rows = {}
    for where, given in (("disk", tiny_packed), ("url", url)):
        out = tmp_path / f"{where}.jsonl"
        ok(ddptrain("predict", trained / "checkpoint.pt", given, "--out", out, "-j", 0))
        rows[where] = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows["url"]) == 39
    for disk, remote in zip(rows["disk"], rows["url"], strict=True):
        assert remote["path"] == url + disk["path"].removeprefix(str(tiny_packed))
        assert {k: v for k, v in remote.items() if k != "path"} == {
            k: v for k, v in disk.items() if k != "path"
        }


def test_a_model_file_naming_an_unknown_arch_is_one_line(trained, tiny_data, tmp_path):
    checkpoint = torch.load(trained / "checkpoint.pt", weights_only=True)
    torch.save({**checkpoint, "arch": "resnet_nope"}, tmp_path / "c.pt")
    out = tmp_path / "p.csv"
    result = ddptrain("predict", tmp_path / "c.pt", tiny_data / "val", "--out", out, "-j", 0)
    assert_user_error(result, f"MODEL {tmp_path}/c.pt says arch is 'resnet_nope': no model")
    assert not out.exists()
