"""Rank 0's view of an epoch: a tqdm bar on a terminal, plain lines elsewhere, or nothing.

`--progress auto` picks the bar when stdout is a terminal and the lines when it is not (CI,
SLURM logs, `| tee`), so logs stay greppable. Both show what the trainer measured at its print
steps; between them the bar only counts steps, which needs no value from the device.

`say` and `counting` are the terminal of whoever has no Reporter: the commands, and a run's
start (process-group init, data checks). The modules below take them as callbacks and never
print themselves.
"""

import contextlib
import sys
import time
from collections.abc import Callable, Iterator

from tqdm import tqdm

from ddptrain.errors import write_line

MODES = ("auto", "bar", "lines", "none")


def shown(mean: float | None, spec: str) -> str:
    """A mean as `spec` formats it, or `-` in its width where there is none
    (metrics.summarize)."""
    return format(mean, spec) if mean is not None else "-".rjust(int(spec.split(".")[0] or 0))


def _line(values: dict) -> str:
    return (
        f"loss {shown(values['loss'], '.4f')} acc1 {shown(values['acc1'], '6.2f')} "
        f"acc5 {shown(values['acc5'], '6.2f')} | {values['samples_per_sec']:7.1f} samples/s "
        f"| data {100 * values['data_wait']:4.1f}%"
    )


def _duration(seconds: float) -> str:
    minutes, seconds = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{seconds:02d}" if hours else f"{minutes}:{seconds:02d}"


class Lines:
    """A line per print step: `epoch 2/12 [ 40/78] loss ... | samples/s | data %`."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stdout
        self.epoch = self.epochs = self.steps = 0

    def begin_epoch(self, epoch: int, epochs: int, first_step: int, steps: int) -> None:
        self.epoch, self.epochs, self.steps = epoch, epochs, steps

    def advance(self) -> None:
        pass  # nothing to show between print steps

    def show(self, step: int, values: dict) -> None:
        width = len(str(self.steps))
        self.write(
            f"epoch {self.epoch + 1}/{self.epochs} [{step:>{width}}/{self.steps}] {_line(values)}"
        )

    def end_epoch(self) -> None:
        pass

    def write(self, line: str) -> None:
        write_line(line, self.stream)


class Bar(Lines):
    """A tqdm bar per epoch: steps, loss, acc1, samples/s and data-wait share as of the last
    print step, and the time left for the epoch (tqdm's) and for the run (from the steps left
    in this and the remaining epochs at this epoch's pace)."""

    def __init__(self, stream=None):
        super().__init__(stream)
        self.bar: tqdm | None = None
        self.started = 0.0
        self.first_step = 0

    def begin_epoch(self, epoch: int, epochs: int, first_step: int, steps: int) -> None:
        super().begin_epoch(epoch, epochs, first_step, steps)
        self.first_step, self.started = first_step, time.perf_counter()
        self.bar = tqdm(
            total=steps,
            initial=first_step,
            desc=f"epoch {epoch + 1}/{epochs}",
            unit="step",
            file=self.stream,
            dynamic_ncols=True,
            leave=True,
        )

    def advance(self) -> None:
        self.bar.update(1)

    def show(self, step: int, values: dict) -> None:
        done = step - self.first_step
        pace = (time.perf_counter() - self.started) / max(done, 1)
        left = (self.steps - step + (self.epochs - self.epoch - 1) * self.steps) * pace
        self.bar.set_postfix_str(
            f"loss {shown(values['loss'], '.4f')} acc1 {shown(values['acc1'], '.2f')} "
            f"{values['samples_per_sec']:.1f} samples/s data {100 * values['data_wait']:.0f}% "
            f"run left {_duration(left)}",
            refresh=True,
        )

    def end_epoch(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def write(self, line: str) -> None:
        if self.bar is None:
            super().write(line)
        else:
            self.bar.write(line, file=self.stream)  # above the bar, which is redrawn below


class Silent(Lines):
    def show(self, step: int, values: dict) -> None:
        pass


def say(line: str, stderr: bool = False) -> None:
    """One line, flushed at once (progress must show while work goes on), from a caller that
    knows it is rank 0 or the only process."""
    write_line(line, sys.stderr if stderr else sys.stdout)  # in one write: see write_line


@contextlib.contextmanager
def counting(total: int, what: str, unit: str) -> Iterator[Callable[[int], None]]:
    """A bar on stderr for long work outside an epoch (checking images), drawn only while stderr
    is a terminal, so logs get no bar; yields advance(n)."""
    with tqdm(total=total, desc=what, unit=unit, disable=None) as bar:
        yield bar.update


@contextlib.contextmanager
def counting_with_lines(total: int, what: str, unit: str) -> Iterator[Callable[[int], None]]:
    """counting's bar on a terminal; elsewhere (a log, a pipe) a plain line on stderr at each
    tenth of the work, for work that takes long enough to want one (packing a data set)."""
    if sys.stderr.isatty():
        with counting(total, what, unit) as advance:
            yield advance
        return
    done = tenths = 0

    def advance(n: int) -> None:
        nonlocal done, tenths
        done += n
        if 10 * done // max(total, 1) > tenths:
            tenths = 10 * done // max(total, 1)
            say(f"{what}: {done}/{total} {unit} ({100 * done // max(total, 1)}%)", stderr=True)

    yield advance


def make_progress(mode: str, stream=None):
    stream = stream or sys.stdout
    if mode == "auto":
        mode = "bar" if stream.isatty() else "lines"
    return {"bar": Bar, "lines": Lines, "none": Silent}[mode](stream)
