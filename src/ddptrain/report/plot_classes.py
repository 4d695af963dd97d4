"""`ddptrain plot`'s per-class figure, from the last evaluation in a run's per_class.jsonl.

Up to MAX_GRID classes: the confusion matrix and each class's precision and recall. Above, a
grid would be unreadable (1,000 classes are a million cells): the WORST classes by recall and
the most confused pairs of classes (true -> predicted), as bars.
"""

import heapq
import json
from pathlib import Path

import torch
from matplotlib.figure import Figure

from ddptrain.report.per_class import cells_of, confusion_of

MAX_GRID = 30  # classes drawn as a matrix, each cell still a few pixels wide
WORST = 20  # classes and pairs shown above MAX_GRID


def last_evaluation(run_dir: Path) -> dict | None:
    """The newest record of the model's val split (the EMA's where there is no other), or None
    without per_class.jsonl. A later record of an epoch wins, a torn line is skipped."""
    path = run_dir / "per_class.jsonl"
    if not path.is_file():
        return None
    latest: dict[str, dict] = {}
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
            if int(record["epoch"]) >= int(latest.get(record["split"], {"epoch": -1})["epoch"]):
                latest[record["split"]] = record
        except (ValueError, KeyError, TypeError):
            continue
    return latest.get("val", latest.get("val_ema"))


def draw_classes(record: dict, title: str) -> Figure:
    figure = Figure(figsize=(15, 7), layout="constrained")
    left, right = figure.subplots(1, 2)
    if len(record["classes"]) <= MAX_GRID:
        _matrix(left, confusion_of(record), record["classes"])
        _precision_recall(right, record)
    else:  # from the non-zero cells: a dense matrix of 21k classes would take gigabytes
        _worst_classes(left, record)
        _confused_pairs(right, record)
    split = "EMA weights" if record["split"] == "val_ema" else "val"
    figure.suptitle(f"ddptrain: {title}, per class ({split}, epoch {record['epoch']})")
    return figure


def _matrix(ax, confusion: torch.Tensor, classes: list[str]) -> None:
    image = ax.imshow(confusion.numpy(), cmap="Blues")
    ticks = range(len(classes))
    ax.set_xticks(ticks, classes, rotation=90)
    ax.set_yticks(ticks, classes)
    ax.set(title="Confusion matrix", xlabel="predicted class", ylabel="true class")
    if len(classes) <= 12:  # counts stay legible in the cells
        high = confusion.max().item()
        for (true, predicted), count in zip(
            torch.cartesian_prod(torch.arange(len(classes)), torch.arange(len(classes))).tolist(),
            confusion.flatten().tolist(),
            strict=True,
        ):
            colour = "white" if count > high / 2 else "black"
            ax.text(predicted, true, count, ha="center", va="center", color=colour)
    ax.figure.colorbar(image, ax=ax, label="images")


def _precision_recall(ax, record: dict) -> None:
    classes = record["classes"]
    rows = torch.arange(len(classes), dtype=torch.float64)
    for offset, key in ((-0.2, "recall"), (0.2, "precision")):
        values = [100 * v if v is not None else 0.0 for v in record[key]]
        ax.barh(rows + offset, values, height=0.4, label=key)
    ax.set_yticks(rows.tolist(), classes)
    ax.invert_yaxis()
    ax.set(title="Per-class recall (= accuracy) and precision", xlabel="%", xlim=(0, 100))
    ax.legend(loc="lower right")


def _worst_classes(ax, record: dict) -> None:
    recall = record["recall"]
    seen = [i for i, value in enumerate(recall) if value is not None]
    worst = sorted(seen, key=lambda i: recall[i])[:WORST]
    ax.barh(range(len(worst)), [100 * recall[i] for i in worst])
    ax.set_yticks(range(len(worst)), [record["classes"][i] for i in worst])
    ax.invert_yaxis()
    ax.set(title=f"The {len(worst)} worst classes (recall = accuracy)", xlabel="%", xlim=(0, 100))


def _confused_pairs(ax, record: dict) -> None:
    classes = record["classes"]
    errors = [(count, true, guess) for true, guess, count in cells_of(record) if true != guess]
    pairs = heapq.nlargest(WORST, errors, key=lambda error: error[0])  # ties: row-major order
    ax.barh(range(len(pairs)), [count for count, _, _ in pairs])
    ax.set_yticks(
        range(len(pairs)), [f"{classes[true]} -> {classes[guess]}" for _, true, guess in pairs]
    )
    ax.invert_yaxis()
    ax.set(title=f"The {len(pairs)} most confused pairs (true -> predicted)", xlabel="images")
