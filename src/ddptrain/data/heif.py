"""The image sizes a HEIF file (HEIC, AVIF: ISO/IEC 23008-12, boxes of the ISO base media file
format) declares, read from its header before anything decodes it.

PIL reads no HEIC, so its header check cannot bound one, while TorchCodec decodes it (through
libheif) at any size and every image it holds. Each coded image of a HEIF file carries its
size in an `ispe` property (meta/iprp/ipco), tied to the image by meta/iprp/ipma: the sum over
those ties bounds what a decoder allocates, the tiles of a grid image and the grid alike.
"""

import struct

# ftyp brands of still images and image sequences in HEIF (HEVC, AV1, and the generic ones)
BRANDS = {
    b"heic", b"heix", b"heim", b"heis", b"hevc", b"hevx", b"mif1", b"mif2", b"miaf", b"msf1",
    b"avif", b"avis", b"avio",
}  # fmt: skip


class Damaged(ValueError):
    """The header is cut short, inconsistent, or declares no image size."""


def is_heif(data: bytes) -> bool:
    """Whether data starts as a HEIF file: an ftyp box naming one of BRANDS."""
    if len(data) < 16 or data[4:8] != b"ftyp":
        return False
    size = int.from_bytes(data[:4], "big")
    brands = data[8:12], *(data[i : i + 4] for i in range(16, min(size, len(data)) - 3, 4))
    return any(brand in BRANDS for brand in brands)


def image_sizes(data: bytes) -> list[tuple[int, int]]:
    """(width, height) of each coded image the file declares, as its ispe properties give them
    (one per image tied to one, by every ipma box: libheif reads them all). Raises Damaged."""
    meta_start, meta_end = _child(data, (0, len(data)), b"meta")
    iprp = _child(data, (meta_start + 4, meta_end), b"iprp")  # meta: a full box, 4 bytes first
    properties = list(_boxes(data, *_child(data, iprp, b"ipco")))
    sizes = []
    for ipma in (span for kind, *span in _boxes(data, *iprp) if kind == b"ipma"):
        for index in _associations(data, *ipma):
            if index == 0:  # "no property"
                continue
            if index > len(properties):
                raise Damaged(f"ipma ties an image to property {index} of {len(properties)}")
            kind, start, end = properties[index - 1]
            if kind == b"ispe":  # a full box: version and flags, then width and height
                sizes.append(struct.unpack_from(">II", data, _within(start + 4, 8, end)))
    if not sizes:
        raise Damaged("no image size (ispe) in its header")
    return sizes


def _boxes(data: bytes, start: int, end: int):
    """(type, content start, content end) of each box from start to end."""
    while start < end:
        size, kind = struct.unpack_from(">I4s", data, _within(start, 8, end))
        header = 8
        if size == 1:
            (size,) = struct.unpack_from(">Q", data, _within(start + 8, 8, end))
            header = 16
        elif size == 0:  # to the end of its parent
            size = end - start
        if size < header or start + size > end:
            raise Damaged(f"box {kind!r} at byte {start} runs past its end")
        yield kind, start + header, start + size
        start += size


def _child(data: bytes, span: tuple[int, int], kind: bytes) -> tuple[int, int]:
    """(content start, content end) of the first box of this kind in span."""
    for found, start, end in _boxes(data, *span):
        if found == kind:
            return start, end
    raise Damaged(f"no {kind.decode()} box")


def _associations(data: bytes, start: int, end: int):
    """The property indices (1-based; 0: none) that an ipma box's content ties to images."""
    version, flags, entries = struct.unpack_from(">B3sI", data, _within(start, 8, end))
    wide = int.from_bytes(flags, "big") & 1  # 16 bits an index, else 8; the top bit apart
    size = 2 if wide else 1
    at = start + 8
    for _ in range(entries):
        at += 4 if version >= 1 else 2  # the item's id
        count = data[_within(at, 1, end)]
        at += 1
        for _ in range(count):
            value = int.from_bytes(data[_within(at, size, end) : at + size], "big")
            yield value & (0x7FFF if wide else 0x7F)
            at += size


def _within(at: int, size: int, end: int) -> int:
    """at, where size bytes from it lie before end (their box's, or the file's)."""
    if at + size > end:
        raise Damaged("cut short")
    return at
