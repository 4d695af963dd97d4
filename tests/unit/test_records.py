import csv
import sys

import pytest

from ddptrain.errors import UserError
from ddptrain.report.records import SummaryCsv, TensorBoardSink


def epoch_records(epoch: int, offset: float = 0.0, ema: bool = False) -> list[dict]:
    """The records of one epoch, as the trainer writes them to metrics.jsonl."""
    train = {"split": "train", "epoch": epoch, "lr": 0.1, "loss": 1.0 / epoch + offset}
    train.update(acc1=10.0 * epoch, acc5=50.0, samples=24, samples_per_sec=100.0 + offset)
    val = {"split": "val", "epoch": epoch, "loss": 1.5 / epoch + offset, "acc1": 9.0 * epoch}
    val.update(acc5=40.0, samples=15)
    extra = [{**val, "split": "val_ema", "acc1": 9.5 * epoch}] if ema else []
    return [train, val, *extra]


def rows(out_dir) -> list[dict]:
    with open(out_dir / "summary.csv", newline="") as f:
        return list(csv.DictReader(f))


def test_summary_has_one_row_per_epoch_with_train_and_val_columns(tmp_path):
    sink = SummaryCsv(tmp_path, enabled=True)
    for epoch in (1, 2):
        for record in epoch_records(epoch, ema=True):
            sink.write(record)
        sink.step({"loss": 0.3}, global_step=epoch * 3)  # no row of its own
    sink.close()
    got = rows(tmp_path)
    assert [r["epoch"] for r in got] == ["1", "2"]
    assert list(got[0])[:4] == ["epoch", "lr", "train_loss", "train_acc1"]
    assert {"train_samples_per_sec", "val_loss", "val_acc1", "val_ema_acc1"} <= set(got[0])
    assert float(got[1]["val_acc1"]) == 18.0 and float(got[1]["val_ema_acc1"]) == 19.0


def test_summary_continues_on_resume_without_duplicate_or_missing_rows(tmp_path):
    first = SummaryCsv(tmp_path, enabled=True)
    for epoch in (1, 2, 3):  # the run died after logging epoch 3, before its checkpoint
        for record in epoch_records(epoch):
            first.write(record)
    resumed = SummaryCsv(tmp_path, enabled=True)
    resumed.keep_until(2)  # it resumes from the epoch-2 checkpoint
    assert [r["epoch"] for r in rows(tmp_path)] == ["1", "2"]
    for epoch in (3, 4):
        for record in epoch_records(epoch, offset=10.0):
            resumed.write(record)
    got = rows(tmp_path)
    assert [r["epoch"] for r in got] == ["1", "2", "3", "4"]
    assert float(got[1]["train_loss"]) == 0.5 and float(got[2]["train_loss"]) == 1 / 3 + 10


def test_columns_a_later_epoch_brings_are_added_blank_before_it(tmp_path):
    sink = SummaryCsv(tmp_path, enabled=True)
    for record in epoch_records(1):
        sink.write(record)
    first_header = list(rows(tmp_path)[0])
    resumed = SummaryCsv(tmp_path, enabled=True)  # --model-ema added on resume
    resumed.keep_until(1)
    for record in epoch_records(2, ema=True):
        resumed.write(record)
    one, two = rows(tmp_path)
    assert list(one) == list(two) and list(one)[: len(first_header)] == first_header
    assert one["val_ema_acc1"] == "" and float(two["val_ema_acc1"]) == 19.0


def test_a_fresh_run_drops_an_earlier_attempts_rows_and_other_ranks_write_nothing(tmp_path):
    for record in epoch_records(1):
        SummaryCsv(tmp_path, enabled=True).write(record)
    fresh = SummaryCsv(tmp_path, enabled=True)
    fresh.keep_until(0)
    assert rows(tmp_path) == []
    other = tmp_path / "rank1"
    other.mkdir()
    quiet = SummaryCsv(other, enabled=False)
    for record in epoch_records(1):
        quiet.write(record)
    quiet.keep_until(0)
    assert not (other / "summary.csv").exists()


def scalars(out_dir, tag) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out_dir / "tensorboard"))
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)]


def train_steps(sink: TensorBoardSink, steps, epoch_every: int, offset: float = 0.0) -> None:
    """Print-step scalars at each step and the epoch's records at its last step."""
    for step in steps:
        sink.step({"loss": step + offset, "acc1": 1.0, "samples_per_sec": 50.0}, step)
        if step % epoch_every == 0:
            for record in epoch_records(step // epoch_every, offset):
                sink.write(record)


def test_tensorboard_has_step_and_epoch_scalars_each_step_once_after_a_resume(tmp_path):
    first = TensorBoardSink(tmp_path, enabled=True)
    train_steps(first, range(1, 8), epoch_every=3)  # dies at step 7, after the step-6 checkpoint
    first.close()
    resumed = TensorBoardSink(tmp_path, enabled=True, after_step=6)
    train_steps(resumed, range(7, 10), epoch_every=3, offset=100.0)
    resumed.close()
    loss = scalars(tmp_path, "step/loss")
    assert [step for step, _ in loss] == list(range(1, 10))
    assert loss[5] == (6, 6.0) and loss[6] == (7, 107.0)  # step 7 from the resumed run only
    assert [step for step, _ in scalars(tmp_path, "val/acc1")] == [3, 6, 9]
    assert [v for _, v in scalars(tmp_path, "train/samples_per_sec")] == [100.0, 100.0, 200.0]
    assert [step for step, _ in scalars(tmp_path, "train/lr")] == [3, 6, 9]


def test_tensorboard_disabled_writes_nothing(tmp_path):
    sink = TensorBoardSink(tmp_path, enabled=False)
    train_steps(sink, range(1, 4), epoch_every=3)
    sink.close()
    assert not (tmp_path / "tensorboard").exists()


def test_tensorboard_missing_is_one_error_saying_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails
    with pytest.raises(UserError, match=r"pip install ddptrain\[tensorboard\]"):
        TensorBoardSink(tmp_path, enabled=True)


def test_another_programs_summary_csv_is_refused_not_rewritten(tmp_path):
    theirs = "name,score\nx,1\n"
    (tmp_path / "summary.csv").write_text(theirs)
    with pytest.raises(UserError, match=r"summary.csv is not ddptrain's"):
        SummaryCsv(tmp_path, True).keep_until(0)
    assert (tmp_path / "summary.csv").read_text() == theirs
