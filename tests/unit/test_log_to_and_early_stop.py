"""--log-to and --early-stop: what they accept; a missing or failing tracker named in one line."""

import json
import sys

import pytest
import torch

from ddptrain.config import Config
from ddptrain.distributed.env import DistEnv
from ddptrain.errors import Stopped, UserError
from ddptrain.report.reporter import Reporter
from ddptrain.report.trackers import require, tracker
from ddptrain.state.checkpointer import TrainState


def test_log_to_takes_mlflow_and_wandb_only():
    assert Config(log_to=("mlflow", "wandb")).report.log_to == ("mlflow", "wandb")
    with pytest.raises(UserError, match=r"--log-to must be one of mlflow, wandb, got 'neptune'"):
        Config(log_to=("mlflow", "neptune"))


def test_early_stop_is_a_patience_of_at_least_0():
    assert Config().optim.early_stop == 0  # never
    with pytest.raises(UserError, match="--early-stop must be at least 0, got -1"):
        Config(early_stop=-1)


def test_the_count_of_epochs_without_a_better_top1_is_checkpointed():
    state = TrainState(epoch=4, best_acc1=50.0, stale_epochs=2)
    assert TrainState.from_checkpoint(state.state_dict()).stale_epochs == 2
    # a checkpoint from before --early-stop resumes with the count at 0
    assert TrainState.from_checkpoint({"epoch": 4, "best_acc1": 50.0}).stale_epochs == 0


@pytest.mark.parametrize("name", ["mlflow", "wandb"])
def test_a_missing_tracker_says_what_to_install(monkeypatch, name):
    monkeypatch.setitem(sys.modules, name, None)  # as if not installed: importing it fails
    with pytest.raises(UserError) as raised:
        require(name)
    assert (
        str(raised.value)
        == f"--log-to {name} needs the {name} package: pip install ddptrain[{name}]"
    )


def test_a_tracker_that_cannot_start_says_so_in_one_line(monkeypatch, tmp_path):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "bogus://nowhere")
    with pytest.raises(UserError, match=r"^--log-to mlflow: starting its run failed: .*bogus"):
        tracker("mlflow", tmp_path, {"lr": 0.1}, resumed=False).keep_until(0)


def closed_status(out_dir, ended_by: BaseException | None) -> str:
    """The MLflow status of a run whose Reporter closes told that ended_by ended it."""
    from mlflow import MlflowClient

    one = DistEnv(0, 1, 0, 1, torch.device("cpu"))
    reporter = Reporter(one, out_dir, progress="none", log_to=("mlflow",))
    reporter.keep_until(0)
    reporter.close(ended_by)
    run_id = json.loads((out_dir / "trackers.json").read_text())["mlflow"]["run_id"]
    return MlflowClient(f"sqlite:///{out_dir}/mlflow.db").get_run(run_id).info.status


def test_mlflow_marks_a_run_by_how_it_ended(tmp_path):
    # three runs in one store: each Reporter starts its own (trackers.json names the latest)
    assert closed_status(tmp_path, None) == "FINISHED"
    assert closed_status(tmp_path, RuntimeError("a bug")) == "FAILED"
    assert closed_status(tmp_path, Stopped(15, "stopped on SIGTERM")) == "KILLED"


def test_a_tracker_failing_to_log_an_epoch_is_a_warning_not_the_runs_end(tmp_path, capsys):
    from mlflow import MlflowClient

    one = DistEnv(0, 1, 0, 1, torch.device("cpu"))
    reporter = Reporter(one, tmp_path, progress="none", log_to=("mlflow",))
    reporter.keep_until(0)
    run_id = json.loads((tmp_path / "trackers.json").read_text())["mlflow"]["run_id"]
    MlflowClient(f"sqlite:///{tmp_path}/mlflow.db").delete_run(run_id)  # logging now fails
    reporter.record({"split": "val", "epoch": 1, "global_step": 2, "loss": 1.0, "acc1": 50.0})
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["acc1"] == 50.0
    warning = capsys.readouterr().err
    assert "--log-to mlflow: logging epoch 1 failed" in warning and "training goes on" in warning


@pytest.mark.parametrize("saved", ["[]", '{"mlflow": 5}', '{"mlflow": {"run_id": 3, "epoch": 1}}'])
def test_a_trackers_json_not_written_by_ddptrain_is_one_line(tmp_path, saved):
    (tmp_path / "trackers.json").write_text(saved)
    with pytest.raises(UserError, match=r"trackers.json is not ddptrain's: move it away"):
        tracker("mlflow", tmp_path, {"lr": 0.1}, resumed=True).keep_until(1)
