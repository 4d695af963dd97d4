"""Accuracy and confusion counts, exact sums over ranks, and the jsonl writer."""

import errno
import json
import os
from pathlib import Path

import torch

from ddptrain import faults
from ddptrain.distributed.collectives import all_sum, gather_from_all
from ddptrain.distributed.env import DistEnv
from ddptrain.errors import UserError, write_failed
from ddptrain.state.files import atomic_write


def topk_correct(output: torch.Tensor, target: torch.Tensor, ks=(1, 5)) -> torch.Tensor:
    """How many rows have the target among their top-k logits, for each k (capped at the class
    count, so acc5 on 3 classes is top-3)."""
    return _hits(_top(output, ks), target, ks)


def _top(output: torch.Tensor, ks) -> torch.Tensor:
    return output.topk(min(max(ks), output.shape[1]), dim=1).indices


def _hits(top: torch.Tensor, target: torch.Tensor, ks) -> torch.Tensor:
    hits = top == target[:, None]
    return torch.stack([hits[:, : min(k, top.shape[1])].any(dim=1).sum() for k in ks])


class Sums:
    """Loss, top-1 and top-5 hits and sample count, summed on the device without host syncs."""

    def __init__(self, device: torch.device):
        dtype = torch.float32 if device.type == "mps" else torch.float64
        self.values = torch.zeros(4, dtype=dtype, device=device)

    def add(self, mean_loss: torch.Tensor, output: torch.Tensor, target: torch.Tensor) -> None:
        n = target.shape[0]
        self.values[0] += mean_loss.detach() * n
        self.values[1:3] += topk_correct(output.detach(), target)
        self.values[3] += n

    def add_masked(
        self, loss_sum: torch.Tensor, output: torch.Tensor, target: torch.Tensor, valid
    ) -> None:
        """A batch whose rows outside `valid` (a bool tensor) are padding: their loss must be
        left out of loss_sum, and their targets must match no class (so no top-k hit)."""
        self.values[0] += loss_sum.detach()
        self.values[1:3] += topk_correct(output.detach(), target)
        self.values[3] += valid.sum()

    def totals(self, env: DistEnv) -> torch.Tensor:
        """The sums over all ranks, on the CPU (a collective: every rank must call it)."""
        values = self.values.clone()
        return all_sum(values.cpu() if _gloo(env) else values, env).cpu()

    def summary(self, env: DistEnv | None = None) -> dict[str, float]:
        """Means over the samples of this rank, or of all ranks when env is given (a collective:
        every rank must call it)."""
        return summarize(self.values if env is None else self.totals(env))


# Classes up to which the confusion counts are one dense C x C tensor; above, its square (8 bytes
# a cell, 128 MB at 4096) outgrows the val set's own (true, predicted) pairs.
DENSE_CONFUSION_LIMIT = 4096


class EvalSums(Sums):
    """Sums, plus the confusion counts of the top-1 predictions (row: true class, column:
    predicted). Up to `dense_limit` classes the counts are flattened after the four sums so that
    one all-reduce carries both, held in the sums' float dtype, exact for counts below 2**53
    (2**24 on mps). Above it, each rank keeps its (true, predicted) pairs, gathered at the end:
    memory and time grow with the val images, not the square of the classes."""

    def __init__(self, device: torch.device, dense_limit: int = DENSE_CONFUSION_LIMIT):
        super().__init__(device)
        self.num_classes = 0  # known at the first batch, from the model's output
        self.dense_limit = dense_limit
        self.cells: list[torch.Tensor] = []  # flat true * C + predicted, above dense_limit

    @property
    def dense(self) -> bool:
        return self.num_classes <= self.dense_limit

    def add_masked(
        self, loss_sum: torch.Tensor, output: torch.Tensor, target: torch.Tensor, valid
    ) -> None:
        output, classes = output.detach(), output.shape[1]
        if not self.num_classes:
            self.num_classes = classes
            if self.dense:
                dtype, device = self.values.dtype, output.device
                cells = torch.zeros(classes * classes, dtype=dtype, device=device)
                self.values = torch.cat([self.values, cells])
        # The top-1 class of the same topk call that counts acc1, so the diagonal sums to it
        # even where logits tie.
        top = _top(output, (1, 5))
        self.values[0] += loss_sum.detach()
        self.values[1:3] += _hits(top, target, (1, 5))
        self.values[3] += valid.sum()
        cells = target[valid] * classes + top[valid, 0]
        if self.dense:
            ones = torch.ones(cells.shape, dtype=self.values.dtype, device=cells.device)
            self.values[4:].index_add_(0, cells, ones)
        else:
            self.cells.append(cells)

    def result(self, env: DistEnv) -> tuple[dict[str, float], torch.Tensor]:
        """The summary over all ranks and the C x C confusion counts (int64, on the CPU; a
        sparse tensor above dense_limit classes). A collective: every rank must call it, after
        the same number of batches."""
        totals, size = self.totals(env), (self.num_classes, self.num_classes)
        if self.dense:
            confusion = totals[4:].round().to(torch.int64)
            return summarize(totals[:4]), confusion.view(size)
        mine = torch.cat(self.cells).cpu() if self.cells else torch.zeros(0, dtype=torch.int64)
        cells = torch.cat(gather_from_all(env, mine))
        pairs = torch.stack([cells // self.num_classes, cells % self.num_classes])
        ones = torch.ones_like(cells)
        confusion = torch.sparse_coo_tensor(pairs, ones, size, check_invariants=True).coalesce()
        return summarize(totals[:4]), confusion


def summarize(totals: torch.Tensor) -> dict[str, float]:
    """Means from (loss sum, top-1 hits, top-5 hits, samples). With no samples (every step so
    far skipped under --nonfinite skip) each mean is None, null in metrics.jsonl: there is
    nothing to average, and a 0 would read as a perfect loss."""
    loss, top1, top5, n = totals[:4].tolist()
    if n == 0:
        return {"loss": None, "acc1": None, "acc5": None, "samples": 0}
    return {"loss": loss / n, "acc1": 100 * top1 / n, "acc5": 100 * top5 / n, "samples": int(n)}


def _gloo(env: DistEnv) -> bool:
    return (
        env.device.type == "cpu" or not env.distributed or torch.distributed.get_backend() == "gloo"
    )


class MetricsLog:
    """Appends one JSON object per line to metrics.jsonl (or, named so, per_class.jsonl); only
    the main rank writes."""

    def __init__(self, out_dir: Path, enabled: bool, name: str = "metrics.jsonl"):
        self.path, self.enabled = out_dir / name, enabled

    def write(self, record: dict) -> None:
        """Appends record; a failed write (a full disk) takes back the part of it that was
        written, so the records before stay whole, and raises WriteFailed naming the file."""
        if not self.enabled:
            return
        line = (json.dumps(record) + "\n").encode()
        try:
            # Unbuffered: a failed write leaves no bytes behind to be flushed after truncating.
            with open(self.path, "ab", buffering=0) as f:
                end = f.tell()
                try:
                    written = f.write(line)
                    faults.disk_full(self.path)
                    if written != len(line):  # a file takes fewer bytes only on a full disk
                        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                except OSError:
                    f.truncate(end)
                    raise
        except OSError as err:
            raise write_failed(self.path, err, needed=len(line)) from None

    def step(self, values: dict, global_step: int) -> None:
        """Print steps are not recorded here (TensorBoard has them)."""

    def close(self) -> None:
        """Every record is appended as it comes."""

    def keep_until(self, epoch: int) -> None:
        """Drops the records of epochs after `epoch`: those of a run that died after logging
        them but before the checkpoint it resumes from, which would otherwise appear twice."""
        if not (self.enabled and self.path.exists()):
            return
        lines, epochs, torn = self._records()
        kept = [line for line, e in zip(lines, epochs, strict=True) if e <= epoch]
        if torn or len(kept) < len(lines):
            atomic_write(self.path, b"".join(kept))

    def check_own(self) -> None:
        """Before `eval` appends, whose out-dir need not be a training run's: refuses a
        metrics.jsonl another program wrote (as keep_until does), and drops a torn last line,
        which the record appended would otherwise continue."""
        if self.enabled and self.path.exists():
            lines, _, torn = self._records()
            if torn:
                atomic_write(self.path, b"".join(lines))

    def _records(self) -> tuple[list[bytes], list[int], bool]:
        """The file's whole lines, the epoch of each, and whether a torn line followed them;
        or a UserError where a line is not a ddptrain record. A crash mid-append leaves a last
        line without its newline (every record begins as that one does)."""
        lines = self.path.read_bytes().splitlines(keepends=True)
        torn = lines and not lines[-1].endswith(b"\n") and lines[-1].startswith(b'{"split": ')
        if torn:
            lines = lines[:-1]
        epochs = [_epoch_of(line) for line in lines]
        if None in epochs:
            raise UserError(
                f"{self.path}: line {epochs.index(None) + 1} is not a ddptrain record: the "
                "--out-dir holds another program's file; move it away or choose another --out-dir"
            )
        return lines, epochs, bool(torn)


def _epoch_of(line: bytes) -> int | None:
    """The epoch of a ddptrain record, or None for a line that is not one."""
    try:
        record = json.loads(line)
        return int(record["epoch"]) if "split" in record else None
    except (ValueError, KeyError, TypeError):
        return None
