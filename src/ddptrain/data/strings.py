"""Many strings in two arrays: a data set's file paths or sample names, as loader workers get them.

A dataset goes to each loader worker pickled (data/fork_server.py). A million paths as a list
of str are a million objects in each worker (docs/performance.md measures ImageNet's), and, in
a worker forked instead, copied page by page as reading them touches their reference counts.
Here they are one bytes object and one array of offsets: one copy of the bytes in each worker,
untouched by reading. Names that are not UTF-8 (a file name's
bytes, os.fsdecode's surrogate escapes) come back as they went in.
"""

from collections.abc import Iterable, Sequence

import numpy as np


class Strings(Sequence[str]):
    """An immutable sequence of str, stored as their UTF-8 bytes end to end."""

    def __init__(self, items: Iterable[str]):
        encoded = [item.encode("utf-8", "surrogateescape") for item in items]
        self._data = b"".join(encoded)
        self._ends = np.cumsum([len(e) for e in encoded], dtype=np.int64)

    def __len__(self) -> int:
        return len(self._ends)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        end = int(self._ends[index])
        start = int(self._ends[index - 1]) if index % len(self) else 0
        return self._data[start:end].decode("utf-8", "surrogateescape")

    def __eq__(self, other) -> bool:
        return list(self) == list(other)

    def __repr__(self) -> str:
        return f"Strings({len(self)} items)"
