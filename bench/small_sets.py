"""Small-image data sets of real-world kinds, made offline, to check recipes on (docs/recipes.md).

    python -m bench.small_sets OUT [--sets digits glyphs tiles] [--seed 0]

writes OUT/<set>/train/<class>/*.png and OUT/<set>/val/<class>/*.png, 32 px RGB:
- digits: scikit-learn's load_digits (1,797 scanned handwritten digits, 8x8, 10 classes),
  upscaled; a stratified split of 1,438 train and 359 val images.
- glyphs: the 26 capital letters rendered from the system's TrueType fonts, each with its own
  weight, slant, scale, rotation, offset, contrast, blur and sensor noise; 55 train and 14 val
  images per letter.
- tiles: tiles of 10 of scikit-image's photographs (the class is the photograph), in grey, cut
  at random sides of 40-96 px and shrunk to 32 px; train tiles from the left 70% of each photo,
  val tiles from the right 30%, so no val pixel was seen in training. 144 train and 36 val
  tiles per photograph.

Needs the bench extra (pip install -e '.[bench]'). The same seed writes the same images.
"""

import argparse
import shutil
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFilter, ImageFont

SIZE = 32
FONT_DIRS = (Path("/usr/share/fonts"), Path("/usr/local/share/fonts"))
PHOTOS = (
    "astronaut",
    "brick",
    "camera",
    "chelsea",
    "coffee",
    "coins",
    "grass",
    "gravel",
    "moon",
    "rocket",
)


def save(out: Path, split: str, label: str, index: int, image: Image.Image) -> None:
    folder = out / split / label
    folder.mkdir(parents=True, exist_ok=True)
    image.convert("RGB").save(folder / f"{index:05d}.png")


def digits(out: Path, seed: int) -> None:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    images, labels = load_digits(return_X_y=True)
    train_x, val_x, train_y, val_y = train_test_split(
        images, labels, test_size=359, stratify=labels, random_state=seed
    )
    for split, x, y in (("train", train_x, train_y), ("val", val_x, val_y)):
        for i, (pixels, label) in enumerate(zip(x, y, strict=True)):
            grey = Image.fromarray((pixels.reshape(8, 8) * (255 / 16)).astype(np.uint8))
            save(out, split, str(label), i, grey.resize((SIZE, SIZE), Image.BICUBIC))


def fonts() -> list[Path]:
    found = sorted({p for d in FONT_DIRS if d.is_dir() for p in d.rglob("*.ttf")})
    # Symbol and math fonts draw capitals as other glyphs, or not at all.
    found = [p for p in found if "Math" not in p.name and "Symbol" not in p.name]
    if not found:
        raise SystemExit("no TrueType fonts found: apt-get install fonts-dejavu-core")
    return found


def glyph(letter: str, font: Path, rng: np.random.Generator) -> Image.Image:
    """One letter as a scan or a photo of print might show it, drawn at 4x and shrunk."""
    big = SIZE * 4
    paper = int(rng.integers(150, 256))
    ink = int(rng.integers(0, paper - 79))  # dark print on light paper, legible
    typeface = ImageFont.truetype(str(font), size=int(big * rng.uniform(0.55, 0.85)))
    mask = Image.new("L", (big, big), 0)
    draw = ImageDraw.Draw(mask)
    left, top, right, bottom = draw.textbbox((0, 0), letter, font=typeface)
    shift = rng.uniform(-0.1, 0.1, 2) * big
    x = (big - (right - left)) / 2 - left + shift[0]
    y = (big - (bottom - top)) / 2 - top + shift[1]
    draw.text((x, y), letter, fill=255, font=typeface)
    mask = mask.rotate(rng.uniform(-8, 8), resample=Image.BILINEAR)
    mask = mask.transform(
        mask.size, Image.AFFINE, (1, rng.uniform(-0.15, 0.15), 0, 0, 1, 0), Image.BILINEAR
    )
    image = Image.composite(Image.new("L", mask.size, ink), Image.new("L", mask.size, paper), mask)
    image = image.resize((SIZE, SIZE), Image.BILINEAR)
    image = image.filter(ImageFilter.GaussianBlur(rng.uniform(0, 0.8)))
    pixels = np.asarray(image, np.float32) + rng.normal(0, rng.uniform(2, 15), (SIZE, SIZE))
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))


def glyphs(out: Path, seed: int, train: int = 55, val: int = 14) -> None:
    faces = fonts()
    for k, letter in enumerate("ABCDEFGHIJKLMNOPQRSTUVWXYZ"):
        rng = np.random.default_rng([seed, k])
        for split, count in (("train", train), ("val", val)):
            for i in range(count):
                face = faces[int(rng.integers(len(faces)))]
                save(out, split, letter, i, glyph(letter, face, rng))


def tiles(out: Path, seed: int, train: int = 144, val: int = 36) -> None:
    import skimage.data

    for k, name in enumerate(PHOTOS):
        rng = np.random.default_rng([seed, 1000 + k])
        photo = Image.fromarray(getattr(skimage.data, name)()).convert("L")
        width, height = photo.size
        cut = int(width * 0.7)
        for split, count, (x0, x1) in (("train", train, (0, cut)), ("val", val, (cut, width))):
            for i in range(count):
                side = int(rng.integers(40, min(97, x1 - x0, height)))
                x = int(rng.integers(x0, x1 - side + 1))
                y = int(rng.integers(0, height - side + 1))
                tile = photo.crop((x, y, x + side, y + side)).resize((SIZE, SIZE), Image.BICUBIC)
                save(out, split, name, i, tile)


SETS = {"digits": digits, "glyphs": glyphs, "tiles": tiles}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--sets", nargs="+", choices=sorted(SETS), default=sorted(SETS))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for name in args.sets:
        root = args.out / name
        shutil.rmtree(root, ignore_errors=True)
        SETS[name](root, args.seed)
        counts = {s: len(list((root / s).rglob("*.png"))) for s in ("train", "val")}
        print(f"{name}: {counts['train']} train, {counts['val']} val images in {root}")


if __name__ == "__main__":
    main()
