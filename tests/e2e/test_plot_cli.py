"""`ddptrain plot` on run directories the real CLI wrote."""

import pytest
from cli import ddptrain, ok, tiny_args

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def runs(tiny_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    ok(ddptrain("train", *tiny_args(tiny_data, root / "lr0.1"), "--epochs", "2"))
    ok(ddptrain("train", *tiny_args(tiny_data, root / "lr0.01"), "--lr", "0.01"))
    return root / "lr0.1", root / "lr0.01"


def test_plot_of_one_run_goes_beside_its_metrics(runs):
    result = ok(ddptrain("plot", runs[0]))
    png, per_class = runs[0] / "metrics.png", runs[0] / "per_class.png"
    assert result.stdout.strip() == f"wrote {png}\nwrote {per_class}"
    assert png.read_bytes().startswith(PNG) and png.stat().st_size > 20_000
    assert per_class.read_bytes().startswith(PNG) and per_class.stat().st_size > 20_000


def test_plot_of_two_runs_overlaid(runs, tmp_path):
    out = tmp_path / "compare.png"
    ok(ddptrain("plot", *runs, "-o", out))
    assert out.read_bytes().startswith(PNG) and out.stat().st_size > 20_000
