"""A packed set trained from a URL: a real HTTP server on 127.0.0.1 (tests/conftest.py's
http_server), one that answers Range requests and one that does not and fails some requests
first. Either way the run's weights are bitwise those of the run on the folder."""

import signal

from cli import assert_same_training, ddptrain, env_with, ok, tiny_args, torchrun
from test_user_errors import assert_user_error

from ddptrain.data.shard_index import INDEX


def test_a_packed_set_at_a_url_trains_to_the_folders_weights(
    tiny_packed, http_server, one_rank_run, tmp_path
):
    url = http_server(tiny_packed)
    cache = tmp_path / "cache"
    ok(ddptrain("train", *tiny_args(url, tmp_path / "run"), "-j", 2, "--cache-dir", cache))
    assert_same_training(one_rank_run, tmp_path / "run")
    assert not list(cache.rglob("*.tar"))  # byte ranges: nothing kept whole


def test_a_server_without_ranges_that_fails_at_first_still_gives_the_same_weights(
    tiny_packed, http_server, two_rank_run, tmp_path
):
    url = http_server(tiny_packed, ranges=False, failures=2)
    cache = tmp_path / "cache"
    args = tiny_args(f"{url}/{INDEX}", tmp_path / "run")
    ok(torchrun(2, "train", *args, "--cache-dir", cache))
    assert_same_training(two_rank_run, tmp_path / "run")
    assert len(list(cache.rglob("*.tar"))) == 6  # every shard, once for the node's two ranks


def test_a_url_run_killed_mid_epoch_resumes_bitwise(tiny_packed, http_server, tmp_path):
    url = http_server(tiny_packed)
    run = ("--epochs", 2, "--checkpoint-every", 1, "-j", 1)
    ok(ddptrain("train", *tiny_args(tiny_packed, tmp_path / "local"), *run))
    out = tmp_path / "url"
    kill = env_with(DDPTRAIN_TEST_KILL="between:0:6")
    killed = ddptrain("train", *tiny_args(url, out), *run, env=kill)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    ok(ddptrain("train", *tiny_args(url, out), *run, "--resume", "auto"))
    assert_same_training(tmp_path / "local", out)


def test_a_url_that_answers_404_is_named_in_one_line(tiny_packed, http_server, tmp_path):
    url = http_server(tiny_packed) + "/nowhere"
    result = ddptrain("train", *tiny_args(url, tmp_path / "run"))
    assert_user_error(result, f"{url}/{INDEX}: not found (404)")
    assert not (tmp_path / "run" / "config.json").exists()


def test_check_reads_a_packed_set_at_a_url(tiny_packed, http_server):
    url = http_server(tiny_packed)
    result = ok(ddptrain("check", url, "-j", 1))
    assert f"all 39 images in {url} decode" in result.stdout
