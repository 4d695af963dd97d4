"""`ddptrain plot`: a run's curves from its metrics.jsonl, several runs overlaid; for one run,
its per-class figure too (report/plot_classes.py).

Panels against epoch: loss, top-1 and top-5 accuracy (train, val and the EMA model's val when
the run has one), learning rate and throughput. Each run keeps one colour; the split is the line
style, so runs compare at a glance and the legend stays short.
"""

import io
import json
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import MaxNLocator

from ddptrain.errors import UserError
from ddptrain.report.plot_classes import draw_classes, last_evaluation
from ddptrain.state.files import atomic_write

# Each split's line style and legend entry.
SPLITS = {"train": ("-", "train"), "val": ("--", "val"), "val_ema": (":", "val, EMA weights")}
PANELS = (  # (record key, splits drawn, title, y label)
    ("loss", ("train", "val", "val_ema"), "Loss", "cross-entropy"),
    ("acc1", ("train", "val", "val_ema"), "Top-1 accuracy", "acc1 (%)"),
    ("acc5", ("train", "val", "val_ema"), "Top-5 accuracy", "acc5 (%)"),
    ("lr", ("train",), "Learning rate", "lr"),
    ("samples_per_sec", ("train",), "Training throughput", "samples/s (all ranks)"),
)

Curves = dict[str, dict[int, dict]]  # split -> epoch -> record


def read_curves(run_dir: Path) -> Curves:
    """The epoch records of run_dir/metrics.jsonl by split and epoch. A later record of an
    epoch wins (an `eval` of the checkpoint appends one); a line torn by a crash is skipped."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        what = "is not a directory" if not run_dir.is_dir() else "holds no metrics.jsonl"
        raise UserError(f"plot: {run_dir} {what}; give the --out-dir of a training run")
    curves: Curves = {}
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
            curves.setdefault(record["split"], {})[int(record["epoch"])] = record
        except (ValueError, KeyError, TypeError):
            continue
    if not curves:
        raise UserError(f"plot: {path} holds no epoch records yet (is the run's first epoch done?)")
    return curves


def default_output(run_dirs: list[Path]) -> Path:
    return run_dirs[0] / "metrics.png" if len(run_dirs) == 1 else Path("compare.png")


def plot(run_dirs: list[Path], out: Path | None = None) -> Path:
    """Draws the runs into one figure, written atomically to out; returns its path."""
    for run_dir in run_dirs:  # what is wrong with a run dir first: -o defaults to inside it
        read_curves(run_dir)
    out = default_output(run_dirs) if out is None else out
    fmt = out.suffix.lstrip(".").lower()
    if fmt not in FigureCanvasAgg.get_supported_filetypes():
        raise UserError(f"plot: -o {out}: cannot write .{fmt} files; use .png, .pdf or .svg")
    if not out.parent.is_dir():
        raise UserError(f"plot: -o {out}: no directory {out.parent}")
    _save(draw(run_dirs), out, fmt)
    return out


def plot_per_class(run_dir: Path, out: Path | None = None) -> Path | None:
    """The per-class figure of one run's last evaluation, beside its curves (per_class.png,
    or FILE-per-class.EXT with -o FILE.EXT); None where the run has no per_class.jsonl."""
    record = last_evaluation(run_dir)
    if record is None:
        return None
    out = run_dir / "per_class.png" if out is None else out.with_stem(f"{out.stem}-per-class")
    _save(draw_classes(record, _labels([run_dir])[0]), out, out.suffix.lstrip(".").lower())
    return out


def _save(figure: Figure, out: Path, fmt: str) -> None:
    FigureCanvasAgg(figure)
    buffer = io.BytesIO()
    figure.savefig(buffer, format=fmt, dpi=100)
    atomic_write(out, buffer.getvalue())  # an earlier plot stays whole if this one fails


def draw(run_dirs: list[Path]) -> Figure:
    """Five panels and a legend: loss, acc1, acc5, lr, samples/s against epoch."""
    runs = dict(zip(_labels(run_dirs), map(read_curves, run_dirs), strict=True))
    figure = Figure(figsize=(15, 8.5), layout="constrained")
    FigureCanvasAgg(figure)  # Agg: no display needed, and no global pyplot state
    axes = figure.subplots(2, 3).flat
    colours = [f"C{i % 10}" for i in range(len(runs))]
    for ax, (key, splits, title, unit) in zip(axes, PANELS, strict=False):
        _panel(ax, runs, colours, key, splits)
        ax.set(title=title, xlabel="epoch", ylabel=unit)
        ax.grid(alpha=0.3)
    _legend(axes[len(PANELS)], runs, colours)
    figure.suptitle("ddptrain: " + " vs ".join(runs))
    return figure


def _labels(run_dirs: list[Path]) -> list[str]:
    """Each run's directory name, or the path as given where two runs share a name."""
    names = [path.resolve().name for path in run_dirs]
    return [
        name if names.count(name) == 1 else str(path)
        for name, path in zip(names, run_dirs, strict=True)
    ]


def _panel(ax, runs: dict[str, Curves], colours: list[str], key: str, splits) -> None:
    values = []
    for colour, curves in zip(colours, runs.values(), strict=True):
        for split in splits:
            epochs = sorted(curves.get(split, {}).items())
            # None: an epoch with no mean (all its steps skipped under --nonfinite skip)
            points = [(e, r[key]) for e, r in epochs if r.get(key) is not None]
            if points:
                epochs, ys = [e for e, _ in points], [y for _, y in points]
                ax.plot(epochs, ys, SPLITS[split][0], color=colour, marker="o", markersize=3)
                values.extend(ys)
    # A stepped schedule, or a loss that starts high or diverges, spans decades: a log axis
    # shows every phase.
    wide = {"lr": 10, "loss": 100}.get(key)
    if wide and values and min(values) > 0 and max(values) / min(values) >= wide:
        ax.set_yscale("log")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # epochs are whole
    if not values:
        ax.text(0.5, 0.5, "not recorded", ha="center", va="center", transform=ax.transAxes)


def _legend(ax, runs: dict[str, Curves], colours: list[str]) -> None:
    """The sixth cell: which colour is which run, which line style which split."""
    ax.axis("off")
    present = {split for curves in runs.values() for split in curves}
    handles = [
        Line2D([], [], color=c, linewidth=3, label=name)
        for name, c in zip(runs, colours, strict=True)
    ]
    handles += [
        Line2D([], [], color="black", linestyle=style, label=label)
        for split, (style, label) in SPLITS.items()
        if split in present
    ]
    ax.legend(handles=handles, loc="center", frameon=False, fontsize="large", title="runs, splits")
