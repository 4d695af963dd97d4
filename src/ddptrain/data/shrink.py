"""`pack --max-side PX`: an image no longer than PX on its longer side, so that a set meant for
small crops decodes fewer pixels in every epoch (on the CPU the decode is the cost).

Never upscaled: an image within PX keeps its bytes. A JPEG is encoded again as JPEG at
--quality; anything else (PNG, BMP, TIFF, WebP, GIF's first frame) as PNG, losslessly. The
pixels are first brought to what training's decoder makes of the file (data/folder.py: RGB,
alpha dropped, 16 bits to 8, turned upright by its EXIF orientation), so that shrinking changes
only the size: the smaller file keeps no EXIF.
"""

import io

import numpy as np
from PIL import ExifTags, Image, ImageOps

from ddptrain.config import MAX_IMAGE_PIXELS
from ddptrain.errors import first_line


def shrink(
    encoded: bytes, ext: str, max_side: int, quality: int, max_pixels: int = MAX_IMAGE_PIXELS
) -> tuple[bytes, str, str | None]:
    """(bytes, extension, None), or the image as it was with why it could not be shrunk (it
    does not decode, or its header declares more than max_pixels: a decompression bomb)."""
    try:
        with Image.open(io.BytesIO(encoded)) as image:
            width, height = image.size
            if max(width, height) <= max_side:
                return encoded, ext, None
            if width * height > max_pixels:
                return encoded, ext, f"{width} x {height} pixels, more than {max_pixels:,}"
            scale = max_side / max(width, height)
            size = (max(1, round(width * scale)), max(1, round(height * scale)))
            jpeg = image.format == "JPEG"
            if jpeg:  # decode at the smallest DCT scale still twice the size: fast, and sharp
                image.draft(None, (2 * size[0], 2 * size[1]))
            if image.getexif().get(ExifTags.Base.Orientation) in (5, 6, 7, 8):
                size = size[::-1]  # a quarter turn to be upright
            upright = ImageOps.exif_transpose(image)
            small = _as_trained(upright).resize(size, Image.Resampling.LANCZOS)
            out = io.BytesIO()
            if jpeg:
                small.save(out, "JPEG", quality=quality)
                return out.getvalue(), "jpg", None
            small.save(out, "PNG")
            return out.getvalue(), "png", None
    except Exception as err:  # PIL's errors vary: any image it cannot shrink is kept as it is
        return encoded, ext, f"{type(err).__name__}: {first_line(err)}"


def _as_trained(image: Image.Image) -> Image.Image:
    """L or RGB pixels, as training's decoder reads the file: 16-bit values keep their high
    byte (torchvision's scaling), alpha and palettes become plain RGB."""
    if image.mode == "L" or image.mode == "RGB":
        return image
    if image.mode.startswith("I"):  # 16-bit grayscale
        high = np.asarray(image).astype(np.uint32) >> 8
        return Image.fromarray(high.clip(0, 255).astype(np.uint8))  # mode L
    return image.convert("RGB")
