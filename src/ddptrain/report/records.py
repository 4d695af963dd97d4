"""Record sinks beside metrics.jsonl: summary.csv (one row per epoch) and TensorBoard.

Each sink takes the same epoch records as metrics.jsonl through `write(record)` (a dict with
"split" and "epoch"), print-step scalars through `step(values, global_step)`, and `close()`.
Only the main rank writes (`enabled`). A resumed run continues them without duplicate or
missing rows: summary.csv drops the rows after the resumed epoch (`keep_until`), and TensorBoard
hides the events after the resumed global step (`purge_step`).
"""

import csv
import io
from pathlib import Path

from ddptrain.errors import UserError
from ddptrain.state.files import atomic_write

# Columns shared by the splits of an epoch rather than prefixed with one.
SHARED = ("epoch", "global_step", "lr")


class SummaryCsv:
    """out_dir/summary.csv: one row per epoch with train_*, val_* (and val_ema_*) columns.

    A key no earlier record had becomes a new last column, blank in the rows before it (the
    val_ema_* columns of an EMA added on resume). The file is rewritten atomically on every
    record, so an epoch's row is whole at once, whatever order its records come in, and a crash
    never leaves a torn line.
    """

    def __init__(self, out_dir: Path, enabled: bool):
        self.path, self.enabled = out_dir / "summary.csv", enabled
        self._rows: dict[int, dict[str, object]] | None = None  # epoch -> row, read lazily
        self._header: list[str] = []

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        rows = self._load()
        epoch = int(record["epoch"])
        row = rows.setdefault(epoch, {"epoch": epoch})
        split = record["split"]
        for key, value in record.items():
            if key != "split":
                row[key if key in SHARED else f"{split}_{key}"] = value
        self._header += [key for key in row if key not in self._header]
        self._save()

    def step(self, values: dict, global_step: int) -> None:
        """Print steps have no row of their own here."""

    def keep_until(self, epoch: int) -> None:
        """Drops the rows of epochs after `epoch` (MetricsLog.keep_until's rule, which see)."""
        if not self.enabled:
            return
        rows = self._load()
        for later in [e for e in rows if e > epoch]:
            del rows[later]
        if not rows:
            self._header = []
        if self.path.exists():
            self._save()

    def close(self) -> None:
        """Every write is already on disk."""

    def _load(self) -> dict[int, dict[str, object]]:
        if self._rows is None:
            self._rows = {}
            if self.path.exists():
                with open(self.path, newline="") as f:
                    reader = csv.DictReader(f)
                    self._header = list(reader.fieldnames or [])
                    if self._header and self._header[0] != "epoch":
                        raise UserError(
                            f"{self.path} is not ddptrain's (its first column is not epoch): "
                            "move it away or choose another --out-dir"
                        )
                    for row in reader:
                        self._rows[int(row["epoch"])] = row
        return self._rows

    def _save(self) -> None:
        text = io.StringIO()
        if self._rows:  # else empty, as metrics.jsonl after keep_until(0)
            writer = csv.DictWriter(text, self._header, extrasaction="ignore", lineterminator="\n")
            writer.writeheader()
            writer.writerows(self._rows[epoch] for epoch in sorted(self._rows))
        atomic_write(self.path, text.getvalue().encode())


def require_tensorboard():
    """SummaryWriter, or one UserError saying how to install it (call it on every rank, so
    that every rank stops, not only the one that writes)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise UserError(
            "--tensorboard needs the tensorboard package: pip install ddptrain[tensorboard]"
        ) from None
    return SummaryWriter


class TensorBoardSink:
    """Event files in out_dir/tensorboard: per print step `step/<key>` (loss, acc1, acc5, lr,
    samples_per_sec, ...) and per epoch `<split>/<key>` (train/loss, val/acc1, ...), all at the
    global step, so one axis serves both and one purge step cleans both on resume.

    `after_step`: the global step the run starts from (the resumed checkpoint's). Events an
    earlier attempt wrote past it (it died before its next checkpoint) are hidden by
    TensorBoard's purge_step, so each step appears once.
    """

    def __init__(self, out_dir: Path, enabled: bool, after_step: int = 0):
        self.enabled = enabled
        self._writer = None
        self._last_step: int | None = None
        if enabled:
            summary_writer = require_tensorboard()
            self._writer = summary_writer(
                log_dir=str(out_dir / "tensorboard"), purge_step=after_step + 1
            )

    def write(self, record: dict) -> None:
        """An epoch record, at its "global_step" when it has one, else at the last print
        step's (the epoch's last step is always a print step)."""
        if self._writer is None:
            return
        global_step = record.get("global_step", self._last_step)
        assert global_step is not None, "an epoch record needs a global_step, or step() before"
        for key, value in scalars(record):
            self._writer.add_scalar(f"{record['split']}/{key}", value, global_step)
        self._writer.flush()  # an epoch's scalars on disk before the checkpoint that follows

    def keep_until(self, epoch: int) -> None:
        """Nothing to drop: purge_step (from after_step) hides what came after the resume."""

    def step(self, values: dict, global_step: int) -> None:
        if self._writer is None:
            return
        self._last_step = global_step
        for key, value in scalars(values):
            self._writer.add_scalar(f"step/{key}", value, global_step)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def scalars(values: dict):
    """The numbers worth a curve: not the bookkeeping (split, epoch, step, sample counts)."""
    for key, value in values.items():
        numeric = isinstance(value, int | float) and not isinstance(value, bool)
        if numeric and key not in ("epoch", "global_step", "samples"):
            yield key, value
