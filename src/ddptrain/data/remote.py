"""Bytes of a packed data set at a URL (http(s)://, and s3://, gs:// and the rest through fsspec).

A rank reads only the samples it trains on, each by a Range request for its member's bytes. A
server that ignores Range answers with the whole shard (plain static servers do): that shard is
then kept whole in a local cache folder, bounded in size and shared by a node's ranks, and read
there. Transient failures are retried with backoff, a bounded number of times; then one line
names the URL.
"""

import contextlib
import hashlib
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


# Clients a forked worker found from its parent: kept, never collected there, since closing
# one in the child would close the parent's sockets too.
_inherited: list = []


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
        self._version = ""  # the digest of the index fetched: the cache's copies are of it

    def __getstate__(self):
        return {**self.__dict__, "_fs": None}

    def url(self, name: str) -> str:
        return f"{self.base}/{name}"

    def size(self, name: str) -> int | None:
        """The file's size, None when there is none."""
        try:
            size = self._retried(name, lambda fs, url: fs.size(url))
        except _Missing:
            return None
        if size is None:
            raise UserError(f"{self.url(name)}: the server gives no size for it")
        return size

    def fetch(self, name: str) -> bytes:
        """The whole file `name`: the index, whose digest names the cache's copies of the
        set's shards, so that a set packed again at the same URL never meets the old ones."""
        data = self._retried(name, lambda fs, path: fs.cat_file(path))
        self._version = hashlib.sha256(data).hexdigest()[:16]
        return data

    def read(self, name: str, offset: int, size: int, whole_size: int) -> bytes:
        """`size` bytes at `offset` of file `name`, whose size is `whole_size`."""
        data = self._from_cache(name, offset, size, whole_size)
        if data is not None:
            return data
        if name in self._whole:
            data = self._retried(name, lambda fs, path: fs.cat_file(path))
        else:
            # By keyword: s3fs's cat_file takes a version_id before start and end.
            data = self._retried(
                name, lambda fs, path: fs.cat_file(path, start=offset, end=offset + size)
            )
            if len(data) == size:
                return data
            self._whole.add(name)  # the server ignores Range: keep the shard whole
        if len(data) != whole_size:
            raise UserError(
                f"{self.url(name)}: asked for {size} bytes at {offset}, got {len(data)} of a "
                f"{whole_size}-byte file: the file changed since the index was written"
            )
        self._keep(name, data)
        return data[offset : offset + size]

    def _from_cache(self, name: str, offset: int, size: int, whole_size: int) -> bytes | None:
        """The bytes from the cache's copy of `name`, None where there is no whole one (another
        process may evict it at any time: a miss, not an error)."""
        path = self._cache_path(name)
        try:
            with open(path, "rb") as f:
                if os.fstat(f.fileno()).st_size != whole_size:  # cut short: fetch it again
                    return None
                os.utime(f.fileno())  # most recently used: evicted last
                return os.pread(f.fileno(), size, offset)
        except (FileNotFoundError, NotADirectoryError):
            return None

    def _cache_path(self, name: str) -> Path:
        # A folder per set: its URL's digest (a long URL makes no overlong name) and its
        # index's; a readable part of the URL for whoever looks in the cache.
        readable = urllib.parse.quote(self.base, safe="")[-48:]
        key = hashlib.sha256(self.base.encode()).hexdigest()[:16]
        return self.cache_dir / f"{readable}-{key}-{self._version}" / name

    def _keep(self, name: str, data: bytes) -> None:
        """data as the cached copy of `name`: written to a temp file, then renamed, so ranks
        starting at once never read a half-written copy; then old copies go past the bound."""
        path = self._cache_path(name)
        temp = None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(temp, path)
        except OSError as err:
            if temp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(temp)
            raise UserError(
                f"--cache-dir {self.cache_dir}: cannot keep {self.url(name)} ({err.strerror}); "
                "free room there, or give another --cache-dir"
            ) from None
        self._evict(keep=path)

    def _evict(self, keep: Path) -> None:
        """Least recently used copies go until the cache is within its bound. A reader that
        finds its copy gone fetches it again (_from_cache)."""
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

            if self._fs is not None:
                _inherited.append(self._fs)
            # Not fsspec's instance cache either: it would hand a worker its parent's client.
            self._fs, _ = fsspec.core.url_to_fs(self.base, skip_instance_cache=True)
            self._pid = os.getpid()
        delay = BACKOFF
        for attempt in range(RETRIES + 1):
            try:
                return request(self._fs, url)
            except FileNotFoundError as err:
                if _not_found(err):
                    raise _Missing(f"{url}: not found (404)") from None
                failure = err.__cause__  # fsspec's HTTP info calls every failure not found
            except PermissionError as err:
                raise UserError(f"{url}: access denied ({err})") from None
            except Exception as err:  # connection errors, timeouts, 5xx: maybe transient
                failure = err
            if attempt == RETRIES:
                said = str(failure).splitlines()[0] if str(failure) else ""
                raise UserError(
                    f"{url}: failed {RETRIES + 1} times, the last with "
                    f"{type(failure).__name__}: {said}"
                ) from None
            time.sleep(delay)
            delay *= 2
        raise AssertionError("unreachable")


def _not_found(err: FileNotFoundError) -> bool:
    """Whether the server said so (404, 410), and not a failure fsspec reports as not found."""
    cause = err.__cause__
    return cause is None or getattr(cause, "status", None) in (404, 410)
