"""per_class.jsonl's records from confusion counts, and their figure at few and many classes."""

import json

import pytest
import torch

from ddptrain.report import plot_classes
from ddptrain.report.per_class import MAX_DENSE, confusion_of, per_class_record
from ddptrain.report.plot import plot_per_class
from ddptrain.report.plot_classes import last_evaluation

PNG = b"\x89PNG\r\n\x1a\n"


def test_figures_of_a_small_confusion_matrix():
    # rows: true class; cat: 3 right, 1 taken for dog; dog: 2 right; bird: never seen
    confusion = torch.tensor([[3, 1, 0], [0, 2, 0], [0, 0, 0]])
    record = per_class_record(confusion, ["cat", "dog", "bird"])
    assert record["confusion"] == confusion.tolist() and "confusion_cells" not in record
    assert record["samples"] == 6
    assert record["recall"] == record["accuracy"] == [0.75, 1.0, None]
    assert record["precision"] == [1.0, 2 / 3, None]


def many_classes(size: int = 1000) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    confusion = torch.diag(torch.randint(0, 10, (size,), generator=generator))
    wrong = torch.randint(0, size, (2, 300), generator=generator)
    confusion.index_put_((wrong[0], wrong[1]), torch.ones(300, dtype=torch.int64), accumulate=True)
    return confusion


def test_above_100_classes_only_the_non_zero_cells_are_stored():
    confusion = many_classes(MAX_DENSE + 1)
    record = per_class_record(confusion, [f"c{i}" for i in range(MAX_DENSE + 1)])
    assert "confusion" not in record
    assert len(record["confusion_cells"]) == int((confusion != 0).sum())
    assert torch.equal(confusion_of(json.loads(json.dumps(record))), confusion)


@pytest.mark.parametrize("size", [5, 1000])
def test_plot_draws_the_last_evaluation(tmp_path, size):
    confusion = many_classes(size)
    classes = [f"class{i}" for i in range(size)]
    lines = [
        {"split": "val", "epoch": epoch, **per_class_record(confusion, classes)} for epoch in (1, 2)
    ]
    (tmp_path / "per_class.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert last_evaluation(tmp_path)["epoch"] == 2
    out = plot_per_class(tmp_path)
    assert out == tmp_path / "per_class.png"
    assert out.read_bytes().startswith(PNG)
    assert plot_per_class(tmp_path / "missing") is None


def test_the_figure_of_21k_classes_comes_from_the_non_zero_cells(monkeypatch):
    """ImageNet-21k's 21,843 classes: a dense matrix would be 3.8 GB of counts."""
    size = 21_843
    cells = [[i, i, 1] for i in range(0, size, 7)] + [[5, 9, 4], [20_000, 3, 6], [7, 8, 4]]
    record = {
        "split": "val",
        "epoch": 1,
        "classes": [f"n{i}" for i in range(size)],
        "confusion_cells": cells,
        "recall": [0.5] * size,
    }

    def dense(record):
        raise AssertionError("a dense matrix of 21,843 classes")

    monkeypatch.setattr(plot_classes, "confusion_of", dense)
    figure = plot_classes.draw_classes(record, "run")
    pairs = figure.axes[1]
    labels = [label.get_text() for label in pairs.get_yticklabels()]
    assert labels == ["n20000 -> n3", "n5 -> n9", "n7 -> n8"]  # by count, ties in row order
    assert [bar.get_width() for bar in pairs.patches] == [6, 4, 4]
