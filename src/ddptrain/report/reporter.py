"""The Reporter: the one place that shows and records what a run does.

Rank 0 shows (a progress bar or lines, the start-up summary, epoch summaries, warnings) and
records (metrics.jsonl, per_class.jsonl, summary.csv, TensorBoard with --tensorboard, MLflow and
W&B with --log-to); other ranks stay quiet.
The modules below return values or raise; the trainer and run.py hand what there is to say to
the Reporter. Before it exists, and in the commands, they take progress.say and counting from
their caller instead: they never print.
"""

from pathlib import Path

from ddptrain.distributed.collectives import agree
from ddptrain.distributed.env import DistEnv
from ddptrain.errors import UserError
from ddptrain.report.metrics import MetricsLog
from ddptrain.report.progress import make_progress, say
from ddptrain.report.records import SummaryCsv, TensorBoardSink
from ddptrain.report.trackers import Tracker, TrackerFailed, tracker


class Reporter:
    def __init__(
        self,
        env: DistEnv,
        out_dir: Path | None,
        progress: str = "auto",
        tensorboard: bool = False,
        resumed_step: int = 0,
        evaluating: bool = False,
        log_to: tuple[str, ...] = (),
        settings: dict | None = None,
    ):
        """out_dir None: show, record nothing. `evaluating` (--evaluate) appends its val line
        to metrics.jsonl (and per_class.jsonl) only: the out-dir may be a training run's, whose
        summary.csv row, TensorBoard curves (purged after the evaluated step) and tracked runs
        are the training's own. `log_to`: the trackers (--log-to), given the run's `settings`."""
        self.env, self.main = env, env.is_main
        self.progress = make_progress(progress if self.main else "none")
        self.sinks: list = []
        self.per_class: MetricsLog | None = None  # per_class.jsonl, its records apart
        self.trackers: list[Tracker] = []  # --log-to, an epoch's records at once
        if self.main and out_dir is not None:
            self.sinks = [MetricsLog(out_dir, True)]
            self.per_class = MetricsLog(out_dir, True, "per_class.jsonl")
            if evaluating:  # training checks them as it resumes (keep_until)
                self.sinks[0].check_own()
                self.per_class.check_own()
            else:
                self.sinks.append(SummaryCsv(out_dir, True))
                if tensorboard:
                    self.sinks.append(TensorBoardSink(out_dir, True, after_step=resumed_step))
                resumed = resumed_step > 0
                self.trackers = [tracker(t, out_dir, settings or {}, resumed) for t in log_to]

    def info(self, line: str) -> None:
        if self.main:
            self.progress.write(line)

    def warn(self, line: str) -> None:
        warn(self.env, line)

    def start(self, summary: dict) -> None:
        """The start-up block: one `name: value` line each."""
        width = max(map(len, summary))
        self.info("\n".join(f"{name:>{width}}: {value}" for name, value in summary.items()))

    def keep_until(self, epoch: int) -> None:
        """Drops records of epochs after `epoch` (a run resumed from before them); the trackers
        start their run, or a resumed run's continue it (report/trackers.py)."""
        for sink in self._logs():
            sink.keep_until(epoch)

    def begin_epoch(self, epoch: int, epochs: int, first_step: int, steps: int) -> None:
        if self.main:
            self.progress.begin_epoch(epoch, epochs, first_step, steps)

    def advance(self) -> None:
        """A step done: no value is read, so no host synchronisation."""
        if self.main:
            self.progress.advance()

    def print_step(self, step: int, global_step: int, values: dict) -> None:
        """values: this rank's running loss, acc1, acc5, samples_per_sec, data_wait."""
        if self.main:
            self.progress.show(step, values)
            for sink in self.sinks:
                sink.step(values, global_step)

    def end_epoch(self) -> None:
        if self.main:
            self.progress.end_epoch()

    def record(self, *records: dict, per_class: list[dict] = ()) -> None:
        """An epoch's records (metrics.jsonl's contract) to every sink, and its evaluations'
        per-class records to per_class.jsonl. A collective: every rank calls it, so that a
        write failing on rank 0 (a full disk) ends every rank at once."""

        def write() -> None:
            for record in records:
                for sink in self.sinks:
                    sink.write(record)
            for record in per_class:
                if self.per_class is not None:
                    self.per_class.write(record)
            # Only warned of: a tracker out of reach must not end the training before this
            # epoch's checkpoint; metrics.jsonl keeps the epoch.
            for each in self.trackers:
                try:
                    each.write_epoch(records)
                except TrackerFailed as err:
                    self.warn(f"{err}; training goes on (metrics.jsonl has the epoch)")

        agree(self.env, write, doing="writing metrics.jsonl, per_class.jsonl and summary.csv")

    def _logs(self) -> list:
        return [*self.sinks, *([] if self.per_class is None else [self.per_class]), *self.trackers]

    def close(self, ended_by: BaseException | None = None) -> None:
        """Ends the records. ended_by: the exception that ended the run, if one did; the
        trackers mark their run stopped or failed by it."""
        self.end_epoch()
        for sink in self.sinks:
            sink.close()
        for each in self.trackers:
            try:
                each.close(ended_by)
            except UserError as err:  # said, not raised: close runs as a failed run ends too
                self.warn(str(err))


def warn(env: DistEnv, line: str) -> None:
    """One warning line on stderr from rank 0: the Reporter's, and the start of a run's, before
    its Reporter exists (a run that fails there still shows why it skipped what it skipped)."""
    if env.is_main:
        say(f"warning: {line}", stderr=True)
