"""Experiment trackers, with --log-to: MLflow and Weights & Biases, given the same epoch
records as metrics.jsonl, an epoch's together.

Both work offline by default: MLflow in a SQLite store in the out-dir (sqlite:///OUT/mlflow.db,
its default kind of store since 3.7; the file store is legacy) unless MLFLOW_TRACKING_URI names
another, W&B in offline mode under OUT/wandb unless WANDB_MODE says otherwise. Each logs the
resolved settings at the start, each epoch record as `<split>/<key>` at step = epoch, and at
the end the run's record files (config.json, metrics.jsonl, per_class.jsonl, summary.csv);
checkpoints stay in the out-dir, where they may be gigabytes.

A resumed run continues the same tracked run: trackers.json in the out-dir keeps each tracker's
run id and the last epoch it logged. A run that died after logging an epoch but before its
checkpoint trains that epoch again on resume, to the same figures (resuming is exact), and a
tracker cannot take back what it logged. MLflow writes each row to its store before the call
returns, so the epochs it logged are not logged again. W&B's service holds rows in a buffer that
a crash loses, so the resumed run logs every epoch it trains, and W&B keeps one row a step: it
ignores a resumed run's rows at steps the run already has.
"""

import contextlib
import json
import logging
import os
import shutil
import time
from pathlib import Path

from ddptrain.errors import Stopped, UserError
from ddptrain.report.records import scalars
from ddptrain.state.files import atomic_write

STATE = "trackers.json"
RECORD_FILES = ("config.json", "metrics.jsonl", "per_class.jsonl", "summary.csv")


def require(name: str):
    """The tracker's package, or one UserError saying how to install it (call it on every
    rank, so that every rank stops, not only the one that logs)."""
    try:
        if name == "mlflow":
            import mlflow

            return mlflow
        import wandb

        return wandb
    except ImportError:
        raise UserError(
            f"--log-to {name} needs the {name} package: pip install ddptrain[{name}]"
        ) from None


class TrackerFailed(UserError):
    """The tracker's library or server failed (not the run's own files)."""


class Tracker:
    """One tracked run, opened as the run goes on from where it starts (keep_until): a fresh
    run starts a new tracked run, a resumed one (resumed: it starts after global step 0)
    continues its own."""

    name = ""
    durable = True  # a logged row is stored when log() returns

    def __init__(self, out_dir: Path, settings: dict, resumed: bool):
        self.out_dir, self.settings, self.resumed = out_dir, settings, resumed
        self.run_id: str | None = None
        self.done = 0  # the last epoch an earlier attempt logged
        self.logged = 0  # the last epoch logged

    def keep_until(self, epoch: int) -> None:
        saved = _read_state(self.out_dir).get(self.name, {}) if self.resumed else {}
        self.logged = int(saved.get("epoch", 0))
        self.done = self.logged if self.durable else min(self.logged, epoch)
        with self._failing("starting its run" if not saved else f"continuing {saved['run_id']}"):
            self.run_id = self.open(saved.get("run_id"))
        self._save_state()

    def write_epoch(self, records: tuple[dict, ...]) -> None:
        """An epoch's records (train, val, ...) as one row at step = epoch: W&B keeps a step's
        row open for more until the next step, so a run that died before it would lose it."""
        epoch = int(records[0]["epoch"])
        if self.run_id is None or epoch <= self.done:
            return
        values = {f"{r['split']}/{key}": value for r in records for key, value in scalars(r)}
        with self._failing(f"logging epoch {epoch}"):
            self.log(values, epoch)
        self.logged = max(self.logged, epoch)
        self._save_state()

    def close(self, ended_by: BaseException | None = None) -> None:
        """Ends the tracked run as finished, or, where `ended_by` (what ended the run, if
        anything did) says so, as stopped or failed."""
        if self.run_id is None:
            return
        try:
            with self._failing(f"ending run {self.run_id}"):
                self.finish([self.out_dir / name for name in RECORD_FILES], outcome(ended_by))
        finally:
            self.run_id = None  # ended, or not to be tried again

    @contextlib.contextmanager
    def _failing(self, doing: str):
        """A tracker's failure (a server out of reach, W&B online without a login) as one
        line naming it, on every rank (the Reporter's writes are agreed)."""
        try:
            yield
        except UserError:
            raise
        except Exception as err:
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise TrackerFailed(f"--log-to {self.name}: {doing} failed: {first}") from None

    def _save_state(self) -> None:
        state = _read_state(self.out_dir)
        state[self.name] = {"run_id": self.run_id, "epoch": self.logged}
        atomic_write(self.out_dir / STATE, json.dumps(state, indent=2).encode())

    def open(self, run_id: str | None) -> str:
        """Starts a run (run_id None) or continues run_id; returns its id."""
        raise NotImplementedError

    def log(self, values: dict[str, float], epoch: int) -> None:
        raise NotImplementedError

    def finish(self, files: list[Path], ended: str) -> None:
        """Uploads files and ends the run; `ended`: "finished", "stopped" or "failed"."""
        raise NotImplementedError


def outcome(ended_by: BaseException | None) -> str:
    """How a run ended: "finished" (nothing ended it early), "stopped" (a stop signal, or an
    interrupt, that a resume continues from) or "failed"."""
    if ended_by is None:
        return "finished"
    if isinstance(ended_by, Stopped) or not isinstance(ended_by, Exception):
        return "stopped"
    return "failed"


class MlflowTracker(Tracker):
    name = "mlflow"

    def open(self, run_id: str | None) -> str:
        require("mlflow")
        from mlflow import MlflowClient
        from mlflow.entities import Param

        # Its INFO lines on creating the store's tables say nothing to a user.
        logging.getLogger("mlflow.store.db.utils").setLevel(logging.WARNING)
        given = os.environ.get("MLFLOW_TRACKING_URI")
        self.client = MlflowClient(given or f"sqlite:///{self.out_dir.resolve()}/mlflow.db")
        if run_id is not None:
            self.client.update_run(run_id, status="RUNNING")
            return run_id
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "ddptrain")
        experiment = self.client.get_experiment_by_name(name)
        if experiment is not None:
            experiment_id = experiment.experiment_id
        else:  # the local store's artifacts beside it, not in the working directory
            location = None if given else str(self.out_dir.resolve() / "mlartifacts")
            experiment_id = self.client.create_experiment(name, artifact_location=location)
        run = self.client.create_run(experiment_id, run_name=self.out_dir.resolve().name)
        # MLflow keeps a parameter's first value: a resumed run's changed settings are in the
        # config.json logged at its end.
        params = [Param(key, str(value)) for key, value in self.settings.items()]
        for start in range(0, len(params), 100):  # log_batch takes 100 parameters at most
            self.client.log_batch(run.info.run_id, params=params[start : start + 100])
        return run.info.run_id

    def log(self, values: dict[str, float], epoch: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(key, value, now, epoch) for key, value in values.items()]
        # synchronous, whatever MLFLOW_ENABLE_ASYNC_LOGGING says: stored before it returns
        self.client.log_batch(self.run_id, metrics=metrics, synchronous=True)

    def finish(self, files: list[Path], ended: str) -> None:
        for path in files:
            if path.is_file():
                self.client.log_artifact(self.run_id, str(path))
        # set_terminated's default status is FINISHED, whatever ended the run.
        status = {"finished": "FINISHED", "stopped": "KILLED", "failed": "FAILED"}[ended]
        self.client.set_terminated(self.run_id, status=status)


class WandbTracker(Tracker):
    name = "wandb"
    durable = False

    def open(self, run_id: str | None) -> str:
        wandb = require("wandb")
        # console "off": wandb would otherwise wrap this process's stdout and stderr.
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "ddptrain"),
            dir=str(self.out_dir),
            mode=os.environ.get("WANDB_MODE", "offline"),
            id=run_id,
            resume="allow" if run_id else None,
            name=self.out_dir.resolve().name,
            config=self.settings,
            settings=wandb.Settings(console="off", silent=True),
        )
        return self.run.id

    def log(self, values: dict[str, float], epoch: int) -> None:
        self.run.log({**values, "epoch": epoch}, step=epoch, commit=True)

    def finish(self, files: list[Path], ended: str) -> None:
        for path in files:  # the run's files folder is what W&B uploads (or `wandb sync`s)
            if path.is_file():
                shutil.copy2(path, Path(self.run.dir) / path.name)
        # W&B marks a run failed by a non-zero exit code; an agreed stop exits 0, as ddptrain.
        self.run.finish(exit_code=1 if ended == "failed" else 0)


def tracker(name: str, out_dir: Path, settings: dict, resumed: bool) -> Tracker:
    return {"mlflow": MlflowTracker, "wandb": WandbTracker}[name](out_dir, settings, resumed)


def _read_state(out_dir: Path) -> dict:
    """Each tracker's {"run_id": str, "epoch": int}, as _save_state wrote them."""
    path = out_dir / STATE
    try:
        state = json.loads(path.read_text()) if path.exists() else {}
    except ValueError:
        state = None
    if not isinstance(state, dict) or not all(map(_saved_run, state.values())):
        raise UserError(f"{path} is not ddptrain's: move it away or choose another --out-dir")
    return state


def _saved_run(entry) -> bool:
    return (
        isinstance(entry, dict)
        and isinstance(entry.get("run_id"), str)
        and type(entry.get("epoch")) is int
    )
