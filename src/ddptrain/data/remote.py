"""Bytes of a packed data set at a URL (http(s)://, and s3://, gs:// and the rest through fsspec).

A rank reads only the samples it trains on, each by a Range request for its member's bytes. A
server that ignores Range answers with the whole shard (plain static servers do): that shard is
then kept whole in a local cache folder (data/shard_cache.py) and read there. Every request has
a connect and a read timeout; transient failures are retried with backoff, a bounded number of
times, the wait said at most once a minute per URL; then one line names the URL. A URL may not
hold a user name or password: it is recorded in the run's settings (config.json, checkpoints).
"""

import copy
import hashlib
import os
import time
import urllib.parse
from pathlib import Path

from ddptrain.config import CREDENTIALS_ADVICE, check_no_credentials
from ddptrain.data import synth
from ddptrain.data.shard_cache import ShardCache, set_folder
from ddptrain.errors import Stopped, UserError, first_line

RETRIES = 5  # tries after the first
BACKOFF = 0.5  # seconds before the first retry, doubled after each (at most about 15 s in all)
# Seconds to connect, and to wait for each next piece of an answer: a server that accepts and
# never answers is given up on, while a large shard that keeps arriving takes as long as it takes.
TIMEOUT = 30.0
SAY_EVERY = 60.0  # seconds between two lines about one URL's retries


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
    fork. `say(line, stderr)` hears of retries, in whichever process makes them."""

    def __init__(
        self,
        base: str,
        cache_dir: str | None = None,
        cache_bytes: int = 10 << 30,
        say=None,
    ):
        check_no_credentials(base, "URL")
        self.base = base.rstrip("/")
        folder = Path(cache_dir) if cache_dir else synth.cache_dir() / "shards"
        self.cache = ShardCache(folder, cache_bytes, ours=not cache_dir)
        self.say = say or self.quiet
        self._fs, self._pid = None, None
        self._whole: set[str] = set()  # shards this process found the server sends only whole
        self._version = ""  # the digest of the index fetched: the cache's copies are of it
        self._said: dict[str, float] = {}  # URL -> when its retries were last said

    @staticmethod
    def quiet(line: str, stderr: bool = False) -> None:
        """The default `say`: nothing shown."""

    def __getstate__(self):
        return {**self.__dict__, "_fs": None}

    def at_index(self) -> tuple["Remote", str]:
        """For a base that names an index file (`.../index.json`): a reader of its folder,
        and the file's name."""
        folder = copy.copy(self)
        folder.base, _, name = self.base.rpartition("/")
        folder._whole, folder._said = set(), {}
        return folder, name

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
        copy = self._copy_path(name)
        data = self.cache.read(copy, offset, size, whole_size)
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
        self.cache.keep(copy, data, self.url(name))
        return data[offset : offset + size]

    def _copy_path(self, name: str) -> Path:
        # A folder per set: its URL's digest (a long URL makes no overlong name) and its
        # index's; a readable part of the URL for whoever looks in the cache.
        readable = urllib.parse.quote(self.base, safe="")
        key = hashlib.sha256(self.base.encode()).hexdigest()[:16]
        return self.cache.folder / set_folder(readable, key, self._version) / name

    def _file_system(self):
        if self._fs is None or self._pid != os.getpid():  # a forked worker makes its own
            import fsspec

            if self._fs is not None:
                _inherited.append(self._fs)
            # Not fsspec's instance cache either: it would hand a worker its parent's client.
            self._fs, _ = fsspec.core.url_to_fs(
                self.base, skip_instance_cache=True, **_options(self.base)
            )
            self._pid = os.getpid()
        return self._fs

    def _retried(self, name: str, request):
        url = self.url(name)
        delay = BACKOFF
        for attempt in range(RETRIES + 1):
            try:
                return request(self._file_system(), url)
            except Stopped:  # a stop request, raised by its handler while this waited
                raise
            except FileNotFoundError as err:
                if _not_found(err):
                    raise _Missing(f"{url}: not found (404)") from None
                failure = err.__cause__  # fsspec's HTTP info calls every failure not found
            except PermissionError as err:
                raise UserError(f"{url}: access denied ({first_line(err)})") from None
            except Exception as err:  # connection errors, timeouts, 5xx: maybe transient
                failure = err
            if getattr(failure, "status", None) in (401, 403):
                raise UserError(
                    f"{url}: access denied ({failure.status}): {CREDENTIALS_ADVICE}"
                ) from None
            if attempt == RETRIES:
                raise UserError(
                    f"{url}: failed {RETRIES + 1} times, the last with {_why(failure)}"
                ) from None
            self._say_waiting(url, failure, delay, RETRIES - attempt)
            time.sleep(delay)
            delay *= 2
        raise AssertionError("unreachable")

    def _say_waiting(self, url: str, failure: BaseException, delay: float, left: int) -> None:
        now = time.monotonic()
        if now - self._said.get(url, -SAY_EVERY) < SAY_EVERY:
            return
        self._said[url] = now
        self.say(
            f"warning: {url}: {_why(failure)}; trying again in {delay:g} s ({left} tries left)",
            stderr=True,
        )


def _options(url: str) -> dict:
    """The options of the file system that reaches the server: the URL's own, or in an fsspec
    chain (`simplecache::https://...`) its last link's, which take them by its protocol."""
    import fsspec

    links = url.split("::")
    protocol = fsspec.core.split_protocol(links[-1])[0]
    options = _reaching(protocol)
    return {protocol: options} if len(links) > 1 and options else options


def _reaching(protocol: str) -> dict:
    """The options of a backend that reaches a server: TIMEOUT, where ddptrain knows its names
    for it, and, for HTTP, credentials and proxies from the environment (~/.netrc,
    HTTPS_PROXY)."""
    if protocol in ("http", "https"):
        import aiohttp

        # aiohttp's default also ends a whole request after 300 s, a large shard's included.
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=TIMEOUT, sock_read=TIMEOUT)
        return {"client_kwargs": {"timeout": timeout, "trust_env": True}}
    if protocol in ("s3", "s3a"):
        return {"config_kwargs": {"connect_timeout": TIMEOUT, "read_timeout": TIMEOUT}}
    return {}


def _why(failure: BaseException | None) -> str:
    if isinstance(failure, TimeoutError):  # fsspec's, aiohttp's and asyncio's are
        return f"no answer within {TIMEOUT:g} s"
    said = str(failure).splitlines()[0] if str(failure) else ""
    return f"{type(failure).__name__}: {said}"


def _not_found(err: FileNotFoundError) -> bool:
    """Whether the server said so (404, 410), and not a failure fsspec reports as not found."""
    cause = err.__cause__
    return cause is None or getattr(cause, "status", None) in (404, 410)
