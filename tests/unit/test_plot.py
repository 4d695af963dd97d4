import json

import pytest
from matplotlib.image import imread

from ddptrain import cli
from ddptrain.errors import UserError
from ddptrain.report.plot import draw, plot, read_curves

PNG = b"\x89PNG\r\n\x1a\n"


def write_metrics(run_dir, epochs: int, ema: bool = False, lr: float = 0.1):
    """metrics.jsonl as a run writes it (docs/files.md)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    lines = []
    for epoch in range(1, epochs + 1):
        train = {"loss": 2.0 / epoch, "acc1": 20.0 * epoch, "acc5": 50.0 + 5 * epoch}
        lines.append({"split": "train", "epoch": epoch, **train, "samples": 96, "lr": lr})
        lines[-1].update(samples_per_sec=400.0 + epoch, data_wait=0.01)
        val = {"loss": 2.2 / epoch, "acc1": 18.0 * epoch, "acc5": 48.0 + 5 * epoch, "samples": 15}
        lines.append({"split": "val", "epoch": epoch, **val})
        if ema:
            lines.append({"split": "val_ema", "epoch": epoch, **val, "acc1": 19.0 * epoch})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return run_dir


def test_one_run_is_drawn_beside_its_metrics(tmp_path):
    run = write_metrics(tmp_path / "r18", 3)
    out = plot([run])
    assert out == run / "metrics.png"
    data = out.read_bytes()
    assert data.startswith(PNG) and len(data) > 20_000
    assert imread(out).shape[:2] == (850, 1500)


def test_several_runs_overlay_into_compare_png_in_the_working_directory(tmp_path, monkeypatch):
    a = write_metrics(tmp_path / "a", 3, ema=True)
    b = write_metrics(tmp_path / "b", 2, lr=0.01)
    monkeypatch.chdir(tmp_path)
    assert cli.main(["plot", str(a), str(b)]) == 0
    data = (tmp_path / "compare.png").read_bytes()
    assert data.startswith(PNG) and len(data) > 20_000


def test_an_epoch_without_means_is_left_out_of_its_curves(tmp_path):
    # An epoch whose steps were all skipped (--nonfinite skip) records null means.
    run = write_metrics(tmp_path / "r", 3)
    lines = (run / "metrics.jsonl").read_text().splitlines()
    lines[0] = json.dumps({**json.loads(lines[0]), "loss": None, "acc1": None, "acc5": None})
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    loss, acc1, *_ = draw([run]).axes
    assert tuple(loss.lines[0].get_xdata()) == tuple(acc1.lines[0].get_xdata()) == (2, 3)
    assert tuple(loss.lines[1].get_xdata()) == (1, 2, 3)  # val


def test_panels_hold_each_run_and_split_with_titles_units_and_legend(tmp_path):
    a = write_metrics(tmp_path / "a", 3, ema=True)
    b = write_metrics(tmp_path / "b", 2)
    axes = draw([a, b]).axes
    loss, acc1, acc5, lr, rate, legend = axes
    assert len(loss.lines) == 5  # a: train, val, val_ema; b: train, val
    assert [tuple(line.get_xdata()) for line in acc1.lines[:1]] == [(1, 2, 3)]
    assert acc1.lines[2].get_ydata()[-1] == 57.0  # a's EMA val acc1 at epoch 3
    assert len(lr.lines) == len(rate.lines) == 2  # train only, one per run
    assert acc1.get_ylabel() == "acc1 (%)" and acc5.get_ylabel() == "acc5 (%)"
    assert rate.get_ylabel().startswith("samples/s") and loss.get_title() == "Loss"
    assert all(ax.get_xlabel() == "epoch" for ax in (loss, acc1, acc5, lr, rate))
    labels = [t.get_text() for t in legend.get_legend().get_texts()]
    assert labels == ["a", "b", "train", "val", "val, EMA weights"]


def test_runs_that_share_a_directory_name_are_told_apart_by_path(tmp_path):
    a = write_metrics(tmp_path / "x" / "run", 1)
    b = write_metrics(tmp_path / "y" / "run", 1)
    labels = [t.get_text() for t in draw([a, b]).axes[-1].get_legend().get_texts()]
    assert labels[:2] == [str(a), str(b)]


def test_a_torn_line_is_skipped_and_a_later_record_of_an_epoch_wins(tmp_path):
    run = write_metrics(tmp_path / "r", 2)
    with open(run / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"split": "val", "epoch": 2, "loss": 0.5, "acc1": 99.0}) + "\n")
        f.write('{"split": "train", "epo')  # a crash mid-append
    curves = read_curves(run)
    assert sorted(curves["train"]) == [1, 2] and curves["val"][2]["acc1"] == 99.0


def test_missing_or_empty_metrics_is_one_error_naming_the_path(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(UserError, match=f"{empty} holds no metrics.jsonl"):
        plot([empty])
    (empty / "metrics.jsonl").write_text("")
    with pytest.raises(UserError, match=f"{empty / 'metrics.jsonl'} holds no epoch records"):
        plot([empty])
    assert cli.main(["plot", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"ddptrain: error: plot: {tmp_path / 'nowhere'} is not a directory")
    assert "Traceback" not in err and not (tmp_path / "compare.png").exists()


def test_output_format_and_directory_are_checked_before_drawing(tmp_path):
    run = write_metrics(tmp_path / "r", 1)
    with pytest.raises(UserError, match=r"-o .*x\.jpq: cannot write \.jpq"):
        plot([run], tmp_path / "x.jpq")
    with pytest.raises(UserError, match="no directory"):
        plot([run], tmp_path / "missing" / "x.png")
    assert plot([run], tmp_path / "x.svg").read_text().lstrip().startswith("<?xml")
