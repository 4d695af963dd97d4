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
    """The per-class figures of a C x C int64 confusion matrix (all ranks' counts)."""
    assert confusion.shape == (len(classes), len(classes)), "one row and column per class"
    right = confusion.diagonal()
    recall = _ratios(right, confusion.sum(dim=1))
    record: dict = {"classes": classes, "samples": int(confusion.sum())}
    if len(classes) > MAX_DENSE:
        cells = confusion.nonzero()
        counts = confusion[cells[:, 0], cells[:, 1]]
        record["confusion_cells"] = torch.cat([cells, counts[:, None]], dim=1).tolist()
    else:
        record["confusion"] = confusion.tolist()
    return {
        **record,
        "accuracy": recall,
        "precision": _ratios(right, confusion.sum(dim=0)),
        "recall": recall,
    }


def _ratios(parts: torch.Tensor, wholes: torch.Tensor) -> list[float | None]:
    return [None if w == 0 else p / w for p, w in zip(parts.tolist(), wholes.tolist(), strict=True)]


def confusion_of(record: dict) -> torch.Tensor:
    """The dense C x C matrix of a per_class.jsonl record, stored either way."""
    if "confusion" in record:
        return torch.tensor(record["confusion"], dtype=torch.int64).view(
            len(record["classes"]), len(record["classes"])
        )
    size = len(record["classes"])
    confusion = torch.zeros(size, size, dtype=torch.int64)
    for true, predicted, count in record["confusion_cells"]:
        confusion[true, predicted] = count
    return confusion
