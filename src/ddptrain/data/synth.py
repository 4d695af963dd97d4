"""The built-in dataset: shapes on cluttered backgrounds, written as a real ImageFolder tree.

Classes differ only by shape; colour, position, scale, rotation and clutter are random, so a
linear model on pixels fails and a small convnet succeeds. Every image comes from its own
seeded generator, so the tree is the same for the same spec on any machine.
"""

import colorsys
import fcntl
import math
import os
import random
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, ImageDraw

from ddptrain import faults
from ddptrain.errors import UserError, WriteFailed, write_failed

VERSION = 4  # bump when the images change, so stale caches are not reused
CANVAS = 128  # shapes are drawn large, then rotated and shrunk: smooth edges at any size
LINES, DOTS = (2, 5), (1, 3)  # clutter per image: (min, max)
BACKGROUND, CLUTTER, SHAPE = (0.0, 0.35), (0.4, 0.6), (0.7, 1.0)  # brightness bands (HSV value)
SCALE = (0.55, 0.9)  # shape side / image side


def _regular(n: int, r: float = 1.0, phase: float = 90.0) -> list[tuple[float, float]]:
    return [
        (
            r * math.cos(math.radians(phase + 360 * k / n)),
            r * math.sin(math.radians(phase + 360 * k / n)),
        )
        for k in range(n)
    ]


def _star() -> list[tuple[float, float]]:
    outer, inner = _regular(5, 1.0), _regular(5, 0.42, 90 + 36)
    return [p for pair in zip(outer, inner, strict=True) for p in pair]


# Each shape: a list of (fill, kind, geometry) strokes in [-1, 1] coordinates.
SHAPES: dict[str, list] = {
    "arrow": [
        (
            255,
            "polygon",
            [(-1, -0.2), (0.15, -0.2), (0.15, -0.7), (1, 0), (0.15, 0.7), (0.15, 0.2), (-1, 0.2)],
        )
    ],
    "bar": [(255, "polygon", [(-1, -0.25), (1, -0.25), (1, 0.25), (-1, 0.25)])],
    "circle": [(255, "ellipse", 0.9)],
    "crescent": [(255, "ellipse", 0.95), (0, "ellipse_at", (0.45, 0.0, 0.8))],
    "cross": [
        (
            255,
            "polygon",
            [
                (-0.25, -1),
                (0.25, -1),
                (0.25, -0.25),
                (1, -0.25),
                (1, 0.25),
                (0.25, 0.25),
                (0.25, 1),
                (-0.25, 1),
                (-0.25, 0.25),
                (-1, 0.25),
                (-1, -0.25),
                (-0.25, -0.25),
            ],
        )
    ],
    "ell": [
        (255, "polygon", [(-0.8, -1), (-0.3, -1), (-0.3, 0.5), (0.8, 0.5), (0.8, 1), (-0.8, 1)])
    ],
    "ring": [(255, "ellipse", 0.95), (0, "ellipse", 0.55)],
    "semicircle": [(255, "pieslice", (0, 180))],
    "square": [(255, "polygon", [(-0.75, -0.75), (0.75, -0.75), (0.75, 0.75), (-0.75, 0.75)])],
    "star": [(255, "polygon", _star())],
    "tee": [
        (
            255,
            "polygon",
            [
                (-0.9, -1),
                (0.9, -1),
                (0.9, -0.5),
                (0.25, -0.5),
                (0.25, 1),
                (-0.25, 1),
                (-0.25, -0.5),
                (-0.9, -0.5),
            ],
        )
    ],
    "triangle": [(255, "polygon", _regular(3))],
}


@dataclass(frozen=True)
class SynthSpec:
    classes: int = 10
    train_per_class: int = 500
    val_per_class: int = 100
    size: int = 40
    seed: int = 0

    def __post_init__(self) -> None:
        if not 2 <= self.classes <= len(SHAPES):
            raise UserError(f"--classes must be between 2 and {len(SHAPES)}, got {self.classes}")
        if self.train_per_class < 1 or self.val_per_class < 1:
            raise UserError("--train-per-class and --val-per-class must be at least 1")
        if self.size < 16:
            raise UserError(f"--size must be at least 16 px, got {self.size}")

    def describe(self) -> str:
        return (
            f"{self.classes} classes x ({self.train_per_class} train + {self.val_per_class} val) "
            f"images of {self.size} px, seed {self.seed}"
        )


def _to_canvas(x: float, y: float) -> tuple[float, float]:
    half = CANVAS / 2
    return half + x * half * 0.95, half + y * half * 0.95


def _mask(shape: str) -> Image.Image:
    mask = Image.new("L", (CANVAS, CANVAS), 0)
    draw = ImageDraw.Draw(mask)
    for fill, kind, geometry in SHAPES[shape]:
        if kind == "polygon":
            draw.polygon([_to_canvas(x, y) for x, y in geometry], fill=fill)
        elif kind in ("ellipse", "ellipse_at", "pieslice"):
            cx, cy, r = (
                geometry
                if kind == "ellipse_at"
                else (0.0, 0.0, 1.0 if kind == "pieslice" else geometry)
            )
            (x0, y0), (x1, y1) = _to_canvas(cx - r, cy - r), _to_canvas(cx + r, cy + r)
            if kind == "pieslice":
                draw.pieslice(
                    [x0, y0 - CANVAS * 0.24, x1, y1 - CANVAS * 0.24], *geometry, fill=fill
                )
            else:
                draw.ellipse([x0, y0, x1, y1], fill=fill)
    return mask


def _colour(rng: random.Random, brightness: tuple[float, float]) -> tuple[int, int, int]:
    """A random hue and saturation at a brightness (HSV value) within the given range."""
    rgb = colorsys.hsv_to_rgb(rng.random(), rng.uniform(0.3, 1.0), rng.uniform(*brightness))
    return tuple(round(255 * c) for c in rgb)


def render(mask: Image.Image, size: int, rng: random.Random) -> Image.Image:
    """One image: a cluttered background with the shape pasted at a random pose and colour."""
    # Any hue, but the shape is always the brightest object on a dark background, with the
    # clutter in between: hard enough to need a convnet, easy enough for a 3-minute demo.
    image = Image.new("RGB", (size, size), _colour(rng, BACKGROUND))
    draw = ImageDraw.Draw(image)
    for _ in range(rng.randint(*LINES)):
        points = [(rng.uniform(0, size), rng.uniform(0, size)) for _ in range(2)]
        draw.line(points, fill=_colour(rng, CLUTTER), width=1)
    for _ in range(rng.randint(*DOTS)):
        x, y, r = rng.uniform(0, size), rng.uniform(0, size), rng.uniform(0.5, size / 16)
        draw.ellipse([x - r, y - r, x + r, y + r], fill=_colour(rng, CLUTTER))
    side = max(4, round(size * rng.uniform(*SCALE)))
    pose = mask.rotate(rng.uniform(0, 360), resample=Image.BILINEAR).resize(
        (side, side), Image.BILINEAR
    )
    x, y = rng.randint(1, size - side - 1), rng.randint(1, size - side - 1)
    image.paste(_colour(rng, SHAPE), (x, y, x + side, y + side), pose)
    return image


def write(
    spec: SynthSpec, out: str | os.PathLike, say: Callable[[str], None] | None = None
) -> Path:
    """Writes the dataset to out (which must not hold files yet), atomically: temp dir, rename.
    A failed write (a full disk) leaves nothing behind and raises WriteFailed naming out.
    say(line), when given, is told of each class written (the synth command's progress)."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"synth: {out} already exists and is not an empty directory")
    try:
        _write_tree(spec, out, say)
    except WriteFailed:
        raise
    except OSError as err:
        raise write_failed(out, err) from None
    return out


def _write_tree(spec: SynthSpec, out: Path, say: Callable[[str], None] | None) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        shapes = sorted(SHAPES)[: spec.classes]
        for k, shape in enumerate(shapes):
            mask = _mask(shape)
            for split, count in (("train", spec.train_per_class), ("val", spec.val_per_class)):
                folder = tmp / split / shape
                folder.mkdir(parents=True)
                for i in range(count):
                    rng = random.Random(f"{VERSION}/{spec.seed}/{split}/{shape}/{i}")
                    render(mask, spec.size, rng).save(folder / f"{i:05d}.png")
                    faults.disk_full(folder / f"{i:05d}.png")
            if say:
                say(f"synth: class {k + 1}/{spec.classes} ({shape}) written")
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ddptrain"


def ensure_builtin(spec: SynthSpec = SynthSpec(), log: Callable[..., None] | None = None) -> Path:
    """The built-in dataset in the user cache, generated on first use. log(line, stderr=True),
    when given (rank 0's progress.say), says that generation starts: it takes a while.

    Several ranks may start at once: the first to take the lock writes (into a temp dir renamed
    into place), the others block on the lock and then find it there. The lock dies with its
    holder, so a crashed writer leaves no stale lock and no half-written tree.
    """
    counts = f"{spec.classes}c-{spec.train_per_class}-{spec.val_per_class}"
    root = cache_dir() / f"synth-v{VERSION}-{counts}-{spec.size}px-s{spec.seed}"
    if root.is_dir():
        return root
    try:
        root.parent.mkdir(parents=True, exist_ok=True)
        with open(root.parent / f".{root.name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not root.is_dir():
                if log:
                    log(
                        f"generating the built-in dataset ({spec.describe()}) into {root}",
                        stderr=True,
                    )
                write(spec, root)
    except OSError as err:  # WriteFailed included: it already names root and the free space
        problem = str(err) if isinstance(err, WriteFailed) else write_failed(root.parent, err)
        raise WriteFailed(
            f"the built-in dataset: {problem}; set XDG_CACHE_HOME to a writable directory "
            "with room, or give DATA"
        ) from None
    return root
