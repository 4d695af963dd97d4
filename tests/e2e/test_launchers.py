import json

import torch
import torchvision
from cli import assert_same_weights, ddptrain, launch, ok, tcp_pair, tiny_args, torchrun, weights


def records(out_dir, split):
    lines = (out_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["split"] == split]


def test_single_process_writes_the_documented_files_and_repeats_bitwise(tiny_data, tmp_path):
    first = ok(ddptrain("train", *tiny_args(tiny_data, tmp_path / "a")))
    ok(ddptrain("train", *tiny_args(tiny_data, tmp_path / "b")))
    assert_same_weights(weights(tmp_path / "a"), weights(tmp_path / "b"))

    out = tmp_path / "a"
    assert {p.name for p in out.iterdir()} >= {
        "checkpoint.pt",
        "model_best.pt",
        "metrics.jsonl",
        "config.json",
    }
    ckpt = torch.load(out / "checkpoint.pt", weights_only=True)
    assert ckpt["epoch"] == 1 and ckpt["arch"] == "resnet18" and ckpt["num_classes"] == 3
    assert ckpt["class_to_idx"] == {"arrow": 0, "bar": 1, "circle": 2}
    assert {"optimizer", "scheduler", "best_acc1", "config", "format_version"} <= ckpt.keys()
    torchvision.models.get_model("resnet18", num_classes=3).load_state_dict(ckpt["model"])

    (train,) = records(out, "train")
    (val,) = records(out, "val")
    assert {"epoch", "loss", "acc1", "acc5", "samples", "samples_per_sec", "lr"} <= train.keys()
    assert train["samples"] == 24 and val["samples"] == 15
    assert json.loads((out / "config.json").read_text())["arch"] == "resnet18"
    assert "epoch 1/1 [3/3]" in first.stdout and "val loss" in first.stdout


def test_every_two_rank_launcher_gives_the_same_weights(tiny_data, tmp_path):
    runs = {
        "torchrun": lambda out: [torchrun(2, "train", *tiny_args(tiny_data, out))],
        "mp.spawn": lambda out: [
            ddptrain(
                "train",
                *tiny_args(tiny_data, out),
                "--multiprocessing-distributed",
                "--nproc-per-node",
                "2",
            )
        ],
        "tcp": lambda out: tcp_pair("train", *tiny_args(tiny_data, out)),
        "torch.distributed.launch": lambda out: [launch(2, "train", *tiny_args(tiny_data, out))],
    }
    results = {}
    for name, start in runs.items():
        out = tmp_path / name
        for result in start(out):
            ok(result)
        results[name] = weights(out)
        (val,) = records(out, "val")
        assert val["samples"] == 15, name  # exact: the uneven val set counted once
        config = json.loads((out / "config.json").read_text())
        assert config["resolved"]["world_size"] == 2 and config["resolved"]["per_rank_batch"] == 4
    reference = results.pop("torchrun")
    for result in results.values():
        assert_same_weights(reference, result)


def test_only_rank_zero_logs(tiny_data, tmp_path):
    result = ok(torchrun(2, "train", *tiny_args(tiny_data, tmp_path)))
    assert result.stdout.count("epoch 1/1 done") == 1


def test_eval_of_a_two_rank_checkpoint_matches_the_logged_validation(
    tiny_data, tmp_path, two_rank_run
):
    # BatchNorm statistics differ across ranks after training: the logged validation must be
    # that of the saved model (rank 0's), or evaluating the checkpoint gives other figures.
    ckpt = two_rank_run / "checkpoint.pt"
    result = ok(
        torchrun(
            2,
            "eval",
            tiny_data,
            "--image-size",
            "16",
            "-b",
            "4",
            "-j",
            "0",
            "--resume",
            ckpt,
            "--out-dir",
            tmp_path / "eval",
        )
    )
    (evaluated,) = records(tmp_path / "eval", "val")
    (trained,) = records(two_rank_run, "val")
    assert evaluated["samples"] == 15 and evaluated["epoch"] == 1
    assert evaluated["acc1"] == trained["acc1"] and evaluated["acc5"] == trained["acc5"]
    assert abs(evaluated["loss"] - trained["loss"]) < 1e-5 * max(1.0, trained["loss"])
    assert "val: loss" in result.stdout
