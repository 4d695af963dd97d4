import os
import signal
import socket
import time

import pytest

from ddptrain.config import Config
from ddptrain.data.remote import Remote
from ddptrain.data.shard_cache import MARKER
from ddptrain.errors import Stopped, UserError

BLOB = bytes(range(256)) * 64  # 16 KiB


@pytest.fixture
def files(tmp_path):
    (tmp_path / "shard.tar").write_bytes(BLOB)
    return tmp_path


def test_a_range_comes_by_a_range_request_and_nothing_is_cached(files, http_server, tmp_path):
    remote = Remote(http_server(files), tmp_path / "cache")
    assert remote.read("shard.tar", 1000, 300, len(BLOB)) == BLOB[1000:1300]
    assert not list((tmp_path / "cache").rglob("shard.tar"))


def test_a_server_that_ignores_range_has_its_shard_cached_whole(files, http_server, tmp_path):
    remote = Remote(http_server(files, ranges=False), tmp_path / "cache")
    assert remote.read("shard.tar", 1000, 300, len(BLOB)) == BLOB[1000:1300]
    (cached,) = (tmp_path / "cache").rglob("shard.tar")
    assert cached.read_bytes() == BLOB
    (files / "shard.tar").unlink()  # later reads come from the copy
    assert remote.read("shard.tar", 5, 10, len(BLOB)) == BLOB[5:15]


def test_transient_failures_are_retried(files, http_server, tmp_path, monkeypatch):
    monkeypatch.setattr("ddptrain.data.remote.BACKOFF", 0.01)
    remote = Remote(http_server(files, failures=3), tmp_path / "cache")
    assert remote.read("shard.tar", 0, 10, len(BLOB)) == BLOB[:10]


def test_a_server_that_keeps_failing_is_named_after_bounded_retries(
    files, http_server, tmp_path, monkeypatch
):
    monkeypatch.setattr("ddptrain.data.remote.BACKOFF", 0.01)
    base = http_server(files, failures=100)
    with pytest.raises(UserError, match=rf"{base}/shard.tar: failed 6 times"):
        Remote(base, tmp_path / "cache").read("shard.tar", 0, 10, len(BLOB))


def test_a_missing_file_is_named_at_once(files, http_server, tmp_path):
    base = http_server(files)
    with pytest.raises(UserError, match=rf"{base}/gone.tar: not found \(404\)"):
        Remote(base, tmp_path / "cache").read("gone.tar", 0, 10, 100)


def test_a_changed_file_is_named(files, http_server, tmp_path):
    base = http_server(files, ranges=False)
    with pytest.raises(UserError, match="the file changed since the index was written"):
        Remote(base, tmp_path / "cache").read("shard.tar", 0, 10, len(BLOB) + 1)


def test_the_cache_keeps_within_its_bound_dropping_the_least_recently_used(tmp_path, http_server):
    for name in "abc":
        (tmp_path / f"{name}.tar").write_bytes(BLOB)
    remote = Remote(http_server(tmp_path, ranges=False), tmp_path / "cache", 2 * len(BLOB))
    for name in "abc":
        remote.read(f"{name}.tar", 0, 1, len(BLOB))
    kept = sorted(p.name for p in (tmp_path / "cache").rglob("*.tar"))
    assert kept == ["b.tar", "c.tar"]


def test_a_cut_short_copy_in_the_cache_is_fetched_again(files, http_server, tmp_path):
    remote = Remote(http_server(files, ranges=False), tmp_path / "cache")
    remote.read("shard.tar", 0, 1, len(BLOB))
    (cached,) = (tmp_path / "cache").rglob("shard.tar")
    cached.write_bytes(BLOB[:100])  # as after a crash of the machine mid-write
    assert remote.read("shard.tar", 5000, 10, len(BLOB)) == BLOB[5000:5010]
    assert cached.read_bytes() == BLOB


def test_a_set_packed_again_at_the_same_url_never_reads_the_old_copies(tmp_path, http_server):
    (tmp_path / "index.json").write_bytes(b"first")
    (tmp_path / "shard.tar").write_bytes(BLOB)
    base = http_server(tmp_path, ranges=False)
    first = Remote(base, tmp_path / "cache")
    first.fetch("index.json")
    first.read("shard.tar", 0, 1, len(BLOB))
    (tmp_path / "index.json").write_bytes(b"second")
    (tmp_path / "shard.tar").write_bytes(BLOB[::-1])  # packed again: the same size
    second = Remote(base, tmp_path / "cache")
    second.fetch("index.json")
    assert second.read("shard.tar", 0, 4, len(BLOB)) == BLOB[::-1][:4]


def test_a_failed_size_request_is_retried_and_a_missing_file_has_none(
    files, http_server, tmp_path, monkeypatch
):
    monkeypatch.setattr("ddptrain.data.remote.BACKOFF", 0.01)
    remote = Remote(http_server(files, failures=2), tmp_path / "cache")
    assert remote.size("shard.tar") == len(BLOB)
    assert remote.size("gone.tar") is None


def test_a_cache_that_cannot_be_written_is_named_with_its_flag(files, http_server, tmp_path):
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    remote = Remote(http_server(files, ranges=False), blocked)
    with pytest.raises(UserError, match=f"--cache-dir {blocked}: cannot keep .*shard.tar"):
        remote.read("shard.tar", 0, 10, len(BLOB))


def test_a_cache_dir_holding_other_files_is_refused_and_left_as_it_was(files, tmp_path):
    mine = tmp_path / "home"
    mine.mkdir()
    (mine / "thesis.tex").write_text("years of work")
    with pytest.raises(UserError, match=rf"--cache-dir {mine} holds files that are not ddptrain"):
        Remote("http://127.0.0.1:9/set", mine, 0)
    assert (mine / "thesis.tex").read_text() == "years of work"
    assert not (mine / MARKER).exists()


def test_eviction_deletes_only_the_copies_ddptrain_wrote(files, http_server, tmp_path):
    cache = tmp_path / "cache"
    remote = Remote(http_server(files, ranges=False), cache, 0)  # every copy evicted at once
    remote.read("shard.tar", 0, 1, len(BLOB))
    assert (cache / MARKER).is_file()  # made and marked by ddptrain
    (set_folder,) = (p for p in cache.iterdir() if p.is_dir())
    strangers = [cache / "notes.txt", set_folder / "draft odd name.txt", set_folder / ".keep"]
    for path in strangers:
        path.write_text("a user's")
    (tmp_path / "elsewhere").write_text("a user's")
    (set_folder / "link.tar").symlink_to(tmp_path / "elsewhere")
    (files / "other.tar").write_bytes(BLOB)
    remote.read("other.tar", 0, 1, len(BLOB))  # evicts all but the copy it keeps
    assert all(path.read_text() == "a user's" for path in strangers)
    assert (tmp_path / "elsewhere").read_text() == "a user's"
    assert sorted(p.name for p in set_folder.iterdir()) == [
        ".keep",
        "draft odd name.txt",
        "link.tar",
        "other.tar",
    ]


def test_ddptrains_own_default_cache_is_taken_even_unmarked(
    files, http_server, tmp_path, monkeypatch
):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    remote = Remote(http_server(files, ranges=False))
    (remote.cache.folder / "an-earlier-version-0000000000000000-").mkdir(parents=True)
    assert remote.read("shard.tar", 3, 4, len(BLOB)) == BLOB[3:7]
    assert (remote.cache.folder / MARKER).is_file()


@pytest.mark.parametrize(
    "url",
    [
        "https://ann:hunter2@example.com/set",
        "s3://KEY:hunter2@bucket/x",
        "simplecache::https://ann:hunter2@example.com/set",
        "https://ann:hun::ter2@example.com/set",  # "::" as an fsspec chain's
    ],
)
def test_a_url_holding_a_password_is_refused_without_showing_it(url):
    for refuse in (lambda: Remote(url), lambda: Config(data=url)):
        with pytest.raises(UserError, match=r"holds a user name or password.*~/.netrc") as raised:
            refuse()
        assert "ter2" not in str(raised.value) and "***@" in str(raised.value)


def test_credentials_come_from_netrc(files, http_server, tmp_path, monkeypatch):
    base = http_server(files, auth="ann:hunter2")
    (tmp_path / "netrc").write_text("machine 127.0.0.1 login ann password hunter2\n")
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    assert Remote(base, tmp_path / "cache").read("shard.tar", 7, 3, len(BLOB)) == BLOB[7:10]


def test_a_refused_access_is_one_line_at_once(files, http_server, tmp_path, monkeypatch):
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    base = http_server(files, auth="ann:hunter2")
    with pytest.raises(UserError, match=rf"^{base}/shard.tar: access denied \(401\): give"):
        Remote(base, tmp_path / "cache").read("shard.tar", 0, 10, len(BLOB))
    assert http_server.servers[-1].requests == [1]  # not tried again


@pytest.fixture
def silent_server():
    """A server that accepts connections and never answers."""
    with socket.create_server(("127.0.0.1", 0)) as listening:
        yield f"http://127.0.0.1:{listening.getsockname()[1]}"


def test_a_server_that_never_answers_is_given_up_on_and_the_wait_said(
    silent_server, tmp_path, monkeypatch
):
    monkeypatch.setattr("ddptrain.data.remote.TIMEOUT", 0.2)
    monkeypatch.setattr("ddptrain.data.remote.BACKOFF", 0.01)
    said = []
    remote = Remote(silent_server, tmp_path / "cache", say=lambda line, stderr: said.append(line))
    started = time.monotonic()
    with pytest.raises(UserError, match=r"shard.tar: failed 6 times, the last with no answer"):
        remote.read("shard.tar", 0, 10, len(BLOB))
    assert time.monotonic() - started < 20
    # once a minute at most: the first retry's line alone
    assert said == [
        f"warning: {silent_server}/shard.tar: no answer within 0.2 s; "
        "trying again in 0.01 s (5 tries left)"
    ]


def test_a_stop_request_while_waiting_for_a_server_is_not_taken_for_a_failure(
    silent_server, tmp_path, monkeypatch
):
    monkeypatch.setattr("ddptrain.data.remote.TIMEOUT", 30.0)

    def stop(signum, frame):  # as train/preempt.py's handler does before the first step
        raise Stopped(signal.SIGTERM, "stopped by SIGTERM")

    previous = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, 0.5)
    try:
        started = time.monotonic()
        with pytest.raises(Stopped):
            Remote(silent_server, tmp_path / "cache").read("shard.tar", 0, 10, len(BLOB))
        assert time.monotonic() - started < 10
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_a_write_that_died_has_its_temp_file_evicted_once_stale(files, http_server, tmp_path):
    cache = tmp_path / "cache"
    remote = Remote(http_server(files, ranges=False), cache, 0)
    remote.read("shard.tar", 0, 1, len(BLOB))
    (set_folder,) = (p for p in cache.iterdir() if p.is_dir())
    stale, fresh = set_folder / ".other.tar.abcd1234", set_folder / ".other.tar.efgh5678"
    for temp in (stale, fresh):
        temp.write_bytes(BLOB)
    os.utime(stale, (time.time() - 7200,) * 2)  # as a rank killed mid-write two hours ago
    (files / "other.tar").write_bytes(BLOB)
    remote.read("other.tar", 0, 1, len(BLOB))
    assert not stale.exists() and fresh.exists()  # a fresh one may be another rank's write
