"""per_class.jsonl's records: from an evaluation's confusion counts, which classes fail and what
they are taken for.

One record per evaluation and split (`val`, `val_ema`, as metrics.jsonl names them): `classes`
(names in index order), `confusion` (rows: true class, columns: predicted class) or, above
MAX_DENSE classes, `confusion_cells` ([true, predicted, count] for the non-zero cells), and per
class `accuracy`, `precision`, `recall` (null where undefined: no image of the class, or none
predicted as it). A class's accuracy is its top-1 accuracy, the share of its images predicted
right, which is its recall (torchmetrics' per-class MulticlassAccuracy is the same figure).
"""

import torch

MAX_DENSE = 100  # classes; above, a dense matrix grows as the square of the class count


def per_class_record(confusion: torch.Tensor, classes: list[str]) -> dict:
    """The per-class figures of a C x C int64 confusion matrix (all ranks' counts), dense or
    sparse: the figures are computed from its non-zero cells, so a sparse one is never made
    dense."""
    size = len(classes)
    assert confusion.shape == (size, size), "one row and column per class"
    nonzero = confusion.to_sparse().coalesce()  # cells in row-major order
    (true, predicted), counts = nonzero.indices(), nonzero.values()
    hit = true == predicted
    right = torch.zeros(size, dtype=torch.int64).index_add_(0, true[hit], counts[hit])
    per_true = torch.zeros(size, dtype=torch.int64).index_add_(0, true, counts)
    per_predicted = torch.zeros(size, dtype=torch.int64).index_add_(0, predicted, counts)
    recall = _ratios(right, per_true)
    record: dict = {"classes": classes, "samples": int(counts.sum())}
    if size > MAX_DENSE:
        record["confusion_cells"] = torch.stack([true, predicted, counts], dim=1).tolist()
    else:
        record["confusion"] = nonzero.to_dense().tolist()
    return {
        **record,
        "accuracy": recall,
        "precision": _ratios(right, per_predicted),
        "recall": recall,
    }


def _ratios(parts: torch.Tensor, wholes: torch.Tensor) -> list[float | None]:
    return [None if w == 0 else p / w for p, w in zip(parts.tolist(), wholes.tolist(), strict=True)]


def cells_of(record: dict) -> list[tuple[int, int, int]]:
    """The non-zero cells (true, predicted, count) of a per_class.jsonl record, stored either
    way, in row-major order."""
    if "confusion_cells" in record:
        return [(int(t), int(p), int(c)) for t, p, c in record["confusion_cells"]]
    return [
        (true, predicted, count)
        for true, row in enumerate(record["confusion"])
        for predicted, count in enumerate(row)
        if count
    ]


def confusion_of(record: dict) -> torch.Tensor:
    """The dense C x C matrix of a per_class.jsonl record, stored either way: C squared
    numbers, for few classes only."""
    size = len(record["classes"])
    confusion = torch.zeros(size, size, dtype=torch.int64)
    for true, predicted, count in cells_of(record):
        confusion[true, predicted] = count
    return confusion
