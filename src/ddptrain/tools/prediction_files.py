"""predict's rows as a file, by its extension: CSV (a header row), JSON Lines or Parquet.

Columns: `path`, then `top1`, `prob1`, ..., `topK`, `probK`, and `error` when an input could not
be read (its classes left empty). A file name that is not UTF-8 is written as its bytes in CSV,
as surrogate escapes in JSON Lines, and with backslash escapes (`caf\\xe9.png`) in Parquet,
whose strings must be UTF-8. The file is written whole, atomically: a run that stops
leaves the earlier file or none, never a partial one that looks complete.
"""

import csv
import io
import json
import tempfile
from pathlib import Path

from ddptrain.errors import UserError
from ddptrain.state.files import atomic_write

FORMATS = (".csv", ".jsonl", ".parquet")


def check(out: Path) -> None:
    """Refuses an --out that could not be written, before any image is read."""
    if out.suffix not in FORMATS:
        raise UserError(f"predict: --out {out} must end in {', '.join(FORMATS)}")
    if out.is_dir():
        raise UserError(f"predict: --out {out} is a directory; give the file to write")
    if not out.parent.is_dir():
        raise UserError(f"predict: --out {out}: no directory {out.parent}")
    _check_writable(out)
    if out.suffix == ".parquet":
        _pyarrow()


def _check_writable(out: Path) -> None:
    """The file is written in place of a temp file beside it (atomic_write), so the directory
    must take a new file. Tried, not read off the permissions, which root and ACLs override."""
    try:
        with tempfile.TemporaryFile(dir=out.parent):
            pass
    except OSError as err:
        raise UserError(
            f"predict: --out {out}: cannot write in {out.parent} ({err.strerror or err}); "
            "give --out a directory you may write in"
        ) from None


def columns(rows: list[dict], topk: int) -> list[str]:
    names = ["path"] + [f"{kind}{k}" for k in range(1, topk + 1) for kind in ("top", "prob")]
    return names + (["error"] if any("error" in row for row in rows) else [])


def write(out: Path, rows: list[dict], topk: int) -> None:
    names = columns(rows, topk)
    writer = {".csv": _csv, ".jsonl": _jsonl, ".parquet": _parquet}[out.suffix]
    atomic_write(out, writer(rows, names))


def _csv(rows: list[dict], names: list[str]) -> bytes:
    text = io.StringIO()
    writer = csv.DictWriter(text, names, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)  # a bad image's classes: empty cells
    return text.getvalue().encode(errors="surrogateescape")


def _jsonl(rows: list[dict], names: list[str]) -> bytes:
    lines = (json.dumps({name: row.get(name) for name in names}) + "\n" for row in rows)
    return "".join(lines).encode()


def _parquet(rows: list[dict], names: list[str]) -> bytes:
    pa, pq = _pyarrow()
    schema = pa.schema(
        [(name, pa.float64() if name.startswith("prob") else pa.string()) for name in names]
    )
    rows = [{name: _utf8(value) for name, value in row.items()} for row in rows]
    table = pa.Table.from_pylist(rows, schema=schema)
    buffer = io.BytesIO()
    pq.write_table(table, buffer)
    return buffer.getvalue()


def _utf8(value):
    """A string with surrogate escapes (a file name's bytes that are not UTF-8) backslash-escaped;
    other values as they are."""
    if not isinstance(value, str):
        return value
    return value.encode(errors="surrogateescape").decode(errors="backslashreplace")


def _pyarrow():
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise UserError(
            "predict: --out *.parquet needs pyarrow: pip install 'ddptrain[tables]'"
        ) from None
    return pa, pq
