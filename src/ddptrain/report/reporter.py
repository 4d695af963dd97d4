"""The Reporter: the one place that shows and records what a run does.

Rank 0 shows (a progress bar or lines, the start-up summary, epoch summaries, warnings) and
records (metrics.jsonl, summary.csv, TensorBoard with --tensorboard); other ranks stay quiet.
The modules below return values or raise; the trainer and run.py hand what there is to say to
the Reporter. Before it exists, and in the commands, they take progress.say and counting from
their caller instead: they never print.
"""

from pathlib import Path

from ddptrain.distributed.collectives import agree
from ddptrain.distributed.env import DistEnv
from ddptrain.report.metrics import MetricsLog
from ddptrain.report.progress import make_progress, say
from ddptrain.report.records import SummaryCsv, TensorBoardSink


class Reporter:
    def __init__(
        self,
        env: DistEnv,
        out_dir: Path | None,
        progress: str = "auto",
        tensorboard: bool = False,
        resumed_step: int = 0,
        evaluating: bool = False,
    ):
        """out_dir None: show, record nothing. `evaluating` (--evaluate) appends its val line
        to metrics.jsonl only: the out-dir may be a training run's, whose summary.csv row and
        TensorBoard curves (purged after the evaluated step) are the training's own."""
        self.env, self.main = env, env.is_main
        self.progress = make_progress(progress if self.main else "none")
        self.sinks: list = []
        if self.main and out_dir is not None:
            self.sinks = [MetricsLog(out_dir, True)]
            if evaluating:  # training checks it as it resumes (keep_until)
                self.sinks[0].check_own()
            else:
                self.sinks.append(SummaryCsv(out_dir, True))
                if tensorboard:
                    self.sinks.append(TensorBoardSink(out_dir, True, after_step=resumed_step))

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
        """Drops records of epochs after `epoch` (a run resumed from before them)."""
        for sink in self.sinks:
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

    def record(self, *records: dict) -> None:
        """An epoch's records (metrics.jsonl's contract) to every sink. A collective: every rank
        calls it, so that a write failing on rank 0 (a full disk) ends every rank at once."""

        def write() -> None:
            for record in records:
                for sink in self.sinks:
                    sink.write(record)

        agree(self.env, write, doing="writing metrics.jsonl and summary.csv")

    def close(self) -> None:
        self.end_epoch()
        for sink in self.sinks:
            sink.close()


def warn(env: DistEnv, line: str) -> None:
    """One warning line on stderr from rank 0: the Reporter's, and the start of a run's, before
    its Reporter exists (a run that fails there still shows why it skipped what it skipped)."""
    if env.is_main:
        say(f"warning: {line}", stderr=True)
