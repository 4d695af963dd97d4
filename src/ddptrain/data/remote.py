"""Bytes of a packed data set at a URL (http(s)://, and s3://, gs:// and the rest through fsspec).

A rank reads only the samples it trains on, each by a Range request for its member's bytes. A
server that ignores Range answers with the whole shard (plain static servers do): that shard is
then kept whole in a local cache folder, bounded in size and shared by a node's ranks, and read
there. Transient failures are retried with backoff, a bounded number of times; then one line
names the URL.
"""

import contextlib
import os
import tempfile
import time
import urllib.parse
from pathlib import Path

from ddptrain.data import synth
from ddptrain.errors import UserError

RETRIES = 5  # tries after the first
BACKOFF = 0.5  # seconds before the first retry, doubled after each (at most about 15 s in all)


def is_url(data: str) -> bool:
    return "://" in data and not data.startswith("file://")


class _Missing(UserError):
    """The server says the file is not there (404)."""


class Remote:
    """Reads byte ranges of files under one base URL. Each process, loader workers included,
    makes its own fsspec file system on first use: fsspec's HTTP client does not survive a
    fork."""

    def __init__(self, base: str, cache_dir: str | None = None, cache_bytes: int = 10 << 30):
        self.base = base.rstrip("/")
        self.cache_dir = Path(cache_dir) if cache_dir else synth.cache_dir() / "shards"
        self.cache_bytes = cache_bytes
        self._fs, self._pid = None, None
        self._whole: set[str] = set()  # shards this process found the server sends only whole

    def __getstate__(self):
        return {**self.__dict__, "_fs": None}

    def url(self, name: str) -> str:
        return f"{self.base}/{name}"

    def size(self, name: str) -> int | None:
        """The file's size, None when there is none."""
        try:
            return self._retried(name, lambda fs, url: fs.size(url))
        except _Missing:
            return None

    def fetch(self, name: str) -> bytes:
        """The whole file `name` (the index)."""
        return self._retried(name, lambda fs, path: fs.cat_file(path))

    def read(self, name: str, offset: int, size: int, whole_size: int) -> bytes:
        """`size` bytes at `offset` of file `name`, whose size is `whole_size`."""
        cached = self._cached(name)
        if cached is None and name not in self._whole:
            # By keyword: s3fs's cat_file takes a version_id before start and end.
            data = self._retried(
                name, lambda fs, path: fs.cat_file(path, start=offset, end=offset + size)
            )
            if len(data) == size:
                return data
            if len(data) != whole_size:
                raise UserError(
                    f"{self.url(name)}: asked for {size} bytes at {offset}, got {len(data)} of a "
                    f"{whole_size}-byte file: the file changed since the index was written"
                )
            self._whole.add(name)  # the server ignores Range: keep the shard whole
            cached = self._keep(name, data)
        if cached is None:
            cached = self._keep(name, self.fetch(name))
        with open(cached, "rb") as f:
            f.seek(offset)
            data = f.read(size)
        if len(data) != size:
            raise UserError(f"{self.url(name)}: the cached copy {cached} is shorter than its index")
        return data

    def _cached(self, name: str) -> Path | None:
        path = self._cache_path(name)
        try:
            os.utime(path)  # most recently used: evicted last
        except FileNotFoundError:
            return None
        return path

    def _cache_path(self, name: str) -> Path:
        # One folder per base URL, so that two data sets never share a shard's name.
        host = urllib.parse.quote(self.base, safe="")
        return self.cache_dir / host / name

    def _keep(self, name: str, data: bytes) -> Path:
        """data as the cached copy of `name`: written to a temp file, then renamed, so ranks
        starting at once never read a half-written copy; then old copies go past the bound."""
        path = self._cache_path(name)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(temp, path)
        self._evict(keep=path)
        return path

    def _evict(self, keep: Path) -> None:
        """Least recently used copies go until the cache is within its bound. A copy another
        process has open stays readable to it (POSIX keeps unlinked files while open)."""
        copies = []
        for path in self.cache_dir.rglob("*"):
            with contextlib.suppress(FileNotFoundError):
                if path.is_file() and not path.name.startswith("."):
                    stat = path.stat()
                    copies.append((stat.st_mtime, stat.st_size, path))
        total = sum(size for _, size, _ in copies)
        for _, size, path in sorted(copies):
            if total <= self.cache_bytes:
                break
            if path != keep:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
                total -= size

    def _retried(self, name: str, request):
        url = self.url(name)
        if self._fs is None or self._pid != os.getpid():  # a forked worker makes its own
            import fsspec

            # Not fsspec's instance cache either: it would hand a worker its parent's client.
            self._fs, _ = fsspec.core.url_to_fs(self.base, skip_instance_cache=True)
            self._pid = os.getpid()
        delay = BACKOFF
        for attempt in range(RETRIES + 1):
            try:
                return request(self._fs, url)
            except FileNotFoundError:
                raise _Missing(f"{url}: not found (404)") from None
            except PermissionError as err:
                raise UserError(f"{url}: access denied ({err})") from None
            except Exception as err:  # connection errors, timeouts, 5xx: maybe transient
                if attempt == RETRIES:
                    raise UserError(
                        f"{url}: failed {RETRIES + 1} times, the last with "
                        f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
                    ) from None
                time.sleep(delay)
                delay *= 2
        raise AssertionError("unreachable")
