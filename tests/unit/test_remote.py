import pytest

from ddptrain.data.remote import Remote
from ddptrain.errors import UserError

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
