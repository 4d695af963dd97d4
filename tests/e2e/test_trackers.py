"""--log-to mlflow and --log-to wandb, offline, read back through the libraries' own readers:
MLflow's client on the SQLite store, W&B's transaction logs through `wandb leet inspect`."""

import json
import subprocess
import sys

import pytest
from cli import DEADLINE, ddptrain, env_with, ok, tiny_args


@pytest.fixture(scope="module")
def tracked(tiny_data, tmp_path_factory):
    """Two epochs logged to both trackers, by a run killed while committing epoch 1's
    checkpoint (global step 3), after its records were logged, and resumed from step 2: it
    trains the end of epoch 1 again, and must not log it twice."""
    out = tmp_path_factory.mktemp("tracked") / "run"
    args = ("train", *tiny_args(tiny_data, out, "--epochs", 2, "--checkpoint-every", 2))
    args = (*args, "--resume", "auto", "--log-to", "mlflow", "wandb")
    killed = ddptrain(*args, env=env_with(DDPTRAIN_TEST_KILL="before_rename:0:3"))
    assert killed.returncode != 0, killed.stdout
    assert [json.loads(line)["epoch"] for line in (out / "metrics.jsonl").open()] == [1, 1]
    result = ok(ddptrain(*args))
    assert "wandb:" not in result.stdout + result.stderr  # W&B stays quiet
    return out


def val_records(out) -> list[dict]:
    records = map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
    return [r for r in records if r["split"] == "val"]


def test_mlflow_has_one_run_with_each_epoch_once(tracked):
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{tracked}/mlflow.db")
    experiment = client.get_experiment_by_name("ddptrain")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED"
    history = client.get_metric_history(run.info.run_id, "val/acc1")
    assert [(m.step, m.value) for m in history] == [
        (r["epoch"], r["acc1"]) for r in val_records(tracked)
    ]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")] == [1, 2]
    assert run.data.params["lr"] == "0.1" and run.data.params["epochs"] == "2"
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config.json", "metrics.jsonl", "per_class.jsonl", "summary.csv"} <= artifacts


def wandb_records(path) -> list[dict]:
    command = [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(path)]
    listing = subprocess.run(command, capture_output=True, text=True, timeout=DEADLINE)
    assert listing.returncode == 0, listing.stderr
    return [json.loads(line) for line in listing.stdout.splitlines()]


def test_wandb_offline_run_has_each_epoch_once(tracked):
    logs = sorted((tracked / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(logs) == 2  # the killed attempt's and the resumed one's
    assert len({path.name for path in logs}) == 1  # one run id
    killed, resumed = ([r for r in wandb_records(p)] for p in logs)
    rows = [history_rows(killed), history_rows(resumed)]
    # The resumed run logs every epoch it trained (from its checkpoint, mid-epoch 1): W&B's
    # service may have lost the killed attempt's row in its buffer.
    assert [row["epoch"] for row in rows[1]] == [1, 2]
    # W&B keeps a run's first row of a step: a resumed run's rows at steps it already has are
    # ignored as it syncs.
    had = max((row["_step"] for row in rows[0]), default=0)
    synced = rows[0] + [row for row in rows[1] if row["_step"] > had]
    assert [(row["epoch"], row["val/acc1"]) for row in synced] == [
        (r["epoch"], r["acc1"]) for r in val_records(tracked)
    ]
    config = next(r["run"]["config"]["update"] for r in resumed if r["type"] == "run")
    assert config["lr"] == 0.1 and config["epochs"] == 2


def history_rows(records) -> list[dict]:
    return [r["history"]["item"] for r in records if r["type"] == "history"]
