import json

import pytest
import torch

from ddptrain.distributed.env import DistEnv
from ddptrain.errors import UserError
from ddptrain.report.metrics import EvalSums, MetricsLog, Sums, topk_correct
from ddptrain.report.per_class import per_class_record
from ddptrain.report.progress import shown


def test_topk_counts():
    output = torch.tensor([[0.9, 0.1, 0.0], [0.1, 0.2, 0.7], [0.3, 0.5, 0.2]])
    target = torch.tensor([0, 0, 2])
    top1, top5 = topk_correct(output, target).tolist()
    assert top1 == 1  # only row 0
    assert top5 == 3  # top-5 on 3 classes is top-3: always a hit


def test_topk_with_many_classes():
    output = torch.arange(10.0).repeat(2, 1)  # class 9 best, class 0 worst
    top1, top5 = topk_correct(output, torch.tensor([9, 4])).tolist()
    assert (top1, top5) == (1, 1)


def test_sums_give_sample_weighted_means():
    sums = Sums(torch.device("cpu"))
    out = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]])
    sums.add(torch.tensor(2.0), out[:2], torch.tensor([0, 0]))  # 2 samples, mean loss 2
    sums.add(torch.tensor(5.0), out[2:], torch.tensor([0]))  # 1 sample, mean loss 5
    s = sums.summary()
    assert s["samples"] == 3 and s["loss"] == 3.0 and round(s["acc1"], 4) == 66.6667


def test_sums_with_no_sample_have_no_means():
    # Every step skipped (--nonfinite skip): nothing to average, where 0 reads as perfect.
    s = Sums(torch.device("cpu")).summary()
    assert s == {"loss": None, "acc1": None, "acc5": None, "samples": 0}
    assert shown(s["loss"], ".4f") == "-" and shown(s["acc1"], "6.2f") == "     -"
    assert shown(0.5, "6.2f") == "  0.50"


def test_many_classes_count_confusion_cells_without_a_square_matrix():
    # 5000 classes: a dense matrix would be 25M cells a batch; the pairs are kept instead.
    classes, sums = 5000, EvalSums(torch.device("cpu"))
    for target, predicted in (([0, 4999, 4999], [0, 4999, 3]), ([7, -100], [7, 0])):
        target = torch.tensor(target)
        output = torch.zeros(len(target), classes)
        output[torch.arange(len(target)), torch.tensor(predicted)] = 1.0
        sums.add_masked(torch.tensor(0.0), output, target, target != -100)
    assert sums.values.numel() < 100
    summary, confusion = sums.result(DistEnv(0, 1, 0, 1, torch.device("cpu")))
    assert summary["samples"] == 4 and summary["acc1"] == 75.0
    record = per_class_record(confusion, [f"c{i}" for i in range(classes)])
    assert record["samples"] == 4
    assert record["confusion_cells"] == [[0, 0, 1], [7, 7, 1], [4999, 3, 1], [4999, 4999, 1]]
    assert record["recall"][4999] == 0.5 and record["precision"][3] == 0.0
    assert record["accuracy"][1] is None


def test_metrics_log_appends_only_on_the_main_rank(tmp_path):
    MetricsLog(tmp_path, enabled=False).write({"split": "val"})
    assert not (tmp_path / "metrics.jsonl").exists()
    log = MetricsLog(tmp_path, enabled=True)
    log.write({"split": "train", "epoch": 1})
    log.write({"split": "val", "epoch": 1})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["split"] for line in lines] == ["train", "val"]


def test_resuming_drops_the_records_logged_after_the_checkpoint(tmp_path):
    log = MetricsLog(tmp_path, enabled=True)
    for epoch in (1, 2, 3):
        log.write({"split": "train", "epoch": epoch})
        log.write({"split": "val", "epoch": epoch})
    with open(log.path, "a") as f:
        f.write('{"split": "tra')  # torn by a crash mid-append
    log.keep_until(2)
    records = [json.loads(line) for line in log.path.read_text().splitlines()]
    assert [(r["split"], r["epoch"]) for r in records] == [
        ("train", 1),
        ("val", 1),
        ("train", 2),
        ("val", 2),
    ]


@pytest.mark.parametrize(
    "theirs", ['{"step": 1, "loss": 2.0}\n{"step": 2}\n', '{"step": 1}\n', '{"step": 1}', "x,y\n"]
)
def test_another_programs_metrics_file_is_refused_not_rewritten(tmp_path, theirs):
    log = MetricsLog(tmp_path, enabled=True)
    log.path.write_text(theirs)
    with pytest.raises(UserError, match=r"metrics.jsonl: line 1 is not a ddptrain record"):
        log.keep_until(0)  # a fresh run's start
    with pytest.raises(UserError, match=r"metrics.jsonl: line 1 is not a ddptrain record"):
        log.check_own()  # `eval`, before appending its record
    assert log.path.read_text() == theirs


def test_eval_appends_to_a_runs_own_metrics_file(tmp_path):
    log = MetricsLog(tmp_path, enabled=True)
    log.check_own()  # none there yet
    log.write({"split": "val", "epoch": 1})
    with open(log.path, "a") as f:
        f.write('{"split": "tra')  # torn by a crash mid-append: the run's own
    log.check_own()
    log.write({"split": "val", "epoch": 2})
    log.keep_until(2)  # every line a record: a resume takes the file as the run's
    records = [json.loads(line) for line in log.path.read_text().splitlines()]
    assert [r["epoch"] for r in records] == [1, 2]
