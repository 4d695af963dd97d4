"""The folder where a node keeps the shards that a server sends only whole (data/remote.py),
shared by the node's ranks and kept within --cache-size by deleting the least recently used.

Since it deletes files there, it deletes only what it wrote: ddptrain makes the folder itself
and marks it (MARKER), refuses a --cache-dir that holds anything but its own copies, and evicts
only copies in folders of the names it gives them, `<end of the URL>-<URL digest>-<index
digest>/<shard path>`, never a file of any other name.
"""

import contextlib
import os
import re
import stat
import tempfile
import time
from pathlib import Path

from ddptrain.data.shard_index import SAFE_PART
from ddptrain.errors import UserError

MARKER = ".ddptrain-shard-cache"
_MARKER_TEXT = (
    "ddptrain keeps the shards of packed sets at URLs here (--cache-dir), and deletes the\n"
    "least recently used to stay within --cache-size: put nothing else in this folder.\n"
)
# What _set_folder names: a set's copies live in one of these, never elsewhere.
_SET_FOLDER = re.compile(r"[^/]{0,48}-[0-9a-f]{16}-(?:[0-9a-f]{16})?")
_TEMP = re.compile(r"\.[A-Za-z0-9._-]+\.[a-z0-9_]{8}")  # keep's, tempfile.mkstemp's name
STALE_TEMP = 3600  # seconds: a temp file older than this was left by a write that died


class ShardCache:
    """Whole copies of shards, each at `folder/<set>/<shard path>`. `ours`: the folder is
    ddptrain's own default (~/.cache/ddptrain/shards), taken as marked even where an earlier
    version left it unmarked."""

    def __init__(self, folder: Path, bound: int, ours: bool = False):
        self.folder, self.bound, self.ours = folder, bound, ours
        self._refuse_foreign()

    def read(self, copy: Path, offset: int, size: int, whole_size: int) -> bytes | None:
        """The bytes from the copy, None where there is no whole one (another process may
        evict it at any time: a miss, not an error)."""
        try:
            with open(copy, "rb") as f:
                if os.fstat(f.fileno()).st_size != whole_size:  # cut short: fetch it again
                    return None
                os.utime(f.fileno())  # most recently used: evicted last
                return os.pread(f.fileno(), size, offset)
        except (FileNotFoundError, NotADirectoryError):
            return None

    def keep(self, copy: Path, data: bytes, url: str) -> None:
        """data as the copy of `url`: written to a temp file, then renamed, so ranks starting
        at once never read a half-written copy; then old copies go past the bound."""
        temp = None
        try:
            self._claim()
            copy.parent.mkdir(parents=True, exist_ok=True)
            fd, temp = tempfile.mkstemp(dir=copy.parent, prefix=f".{copy.name}.")
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(temp, copy)
        except OSError as err:
            if temp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(temp)
            raise UserError(
                f"--cache-dir {self.folder}: cannot keep {url} ({err.strerror}); free room "
                "there, or give another --cache-dir"
            ) from None
        self._evict(keep=copy)

    def _refuse_foreign(self) -> None:
        """A folder that holds files and no MARKER is someone else's: eviction would delete
        them. One that does not exist yet is made on first use."""
        try:
            entries = os.listdir(self.folder)
        except (FileNotFoundError, NotADirectoryError):
            return  # made on first use, or said then (keep)
        except OSError as err:
            raise UserError(f"--cache-dir {self.folder}: cannot read it ({err.strerror})") from None
        if entries and MARKER not in entries and not self.ours:
            raise UserError(
                f"--cache-dir {self.folder} holds files that are not ddptrain's shard cache (it "
                f"has no {MARKER}), and the cache deletes old files in its folder: give a new "
                "or empty folder"
            )

    def _claim(self) -> None:
        """Makes the folder where needed and marks it, before anything else goes in: ranks that
        race here all find it empty or marked."""
        self.folder.mkdir(parents=True, exist_ok=True)
        if MARKER in os.listdir(self.folder):
            return
        self._refuse_foreign()  # something came in since the run started
        (self.folder / MARKER).write_text(_MARKER_TEXT)

    def _evict(self, keep: Path) -> None:
        """Least recently used copies go until the cache is within its bound. A reader that
        finds its copy gone fetches it again (read)."""
        copies = list(self._copies())
        total = sum(size for _, size, _ in copies)
        for _, size, path in sorted(copies):
            if total <= self.bound:
                break
            if path != keep:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
                total -= size

    def _copies(self):
        """(modified, size, path) of each copy: regular files of shard names in set folders of
        a marked cache, and the temp files of a write that a killed process left there an
        hour ago or more; links are not followed."""
        if not (self.folder / MARKER).is_file():
            return
        for entry in os.scandir(self.folder):
            if not (_SET_FOLDER.fullmatch(entry.name) and entry.is_dir(follow_symlinks=False)):
                continue
            for where, folders, files in os.walk(entry.path):
                folders[:] = [f for f in folders if SAFE_PART.fullmatch(f)]
                for name in files:
                    temp = _TEMP.fullmatch(name)
                    if not (temp or SAFE_PART.fullmatch(name) and not name.startswith(".")):
                        continue  # no name of ours
                    path = Path(where, name)
                    with contextlib.suppress(FileNotFoundError):
                        found = path.lstat()
                        stale = not temp or time.time() - found.st_mtime > STALE_TEMP
                        if stat.S_ISREG(found.st_mode) and stale:
                            yield found.st_mtime, found.st_size, path


def set_folder(readable: str, url_digest: str, index_digest: str) -> str:
    """The name of a set's folder in the cache: what _SET_FOLDER matches."""
    name = f"{readable[-48:]}-{url_digest}-{index_digest}"
    assert _SET_FOLDER.fullmatch(name), name
    return name
