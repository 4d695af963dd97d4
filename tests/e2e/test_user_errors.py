"""User mistakes end every rank with one `ddptrain: error:` line, a non-zero exit, no hang."""

import shutil
import time

import pytest
from cli import copy_run, ddptrain, ok, tcp_pair, tiny_args, torchrun

DEADLINE = 60


@pytest.fixture
def data(tiny_data, tmp_path):
    copy = tmp_path / "data"
    shutil.copytree(tiny_data, copy)
    return copy


def assert_user_error(result, *needles, traceback_allowed=False):
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.startswith("ddptrain: error: ")]
    assert lines, result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    if not traceback_allowed:
        assert "Traceback" not in result.stderr, result.stderr


def timed(run):
    start = time.monotonic()
    result = run()
    assert time.monotonic() - start < DEADLINE
    return result


def test_missing_data_directory(tmp_path):
    result = timed(lambda: ddptrain("train", *tiny_args(tmp_path / "nowhere", tmp_path / "out")))
    assert_user_error(result, "nowhere")


def test_missing_val_directory(data, tmp_path):
    shutil.rmtree(data / "val")
    result = timed(lambda: ddptrain("train", *tiny_args(data, tmp_path / "out")))
    assert_user_error(result, str(data / "val"))


def test_empty_class_folder(data, tmp_path):
    for f in (data / "train" / "bar").iterdir():
        f.unlink()
    assert_user_error(timed(lambda: ddptrain("train", *tiny_args(data, tmp_path / "out"))), "bar")


def test_mismatched_class_sets(data, tmp_path):
    (data / "val" / "circle").rename(data / "val" / "disc")
    result = timed(lambda: ddptrain("train", *tiny_args(data, tmp_path / "out")))
    assert_user_error(result, "circle", "disc")


def test_unreadable_image_in_a_loader_worker(data, tmp_path):
    bad = data / "train" / "bar" / "00003.png"
    bad.write_bytes(b"not an image")
    result = timed(lambda: ddptrain("train", *tiny_args(data, tmp_path / "out"), "-j", "2"))
    assert_user_error(result, str(bad), "--bad-images skip")


def test_unknown_arch(tiny_data, tmp_path):
    result = timed(lambda: ddptrain("train", *tiny_args(tiny_data, tmp_path), "-a", "get_model"))
    assert_user_error(result, "--arch", "get_model")


def test_bad_flag_value(tiny_data, tmp_path):
    assert_user_error(timed(lambda: ddptrain("train", tiny_data, "-b", "many")), "-b")


def test_resume_with_another_arch_leaves_the_run_untouched(tiny_data, tmp_path, one_rank_run):
    out = copy_run(one_rank_run, tmp_path / "run")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    result = timed(
        lambda: ddptrain(
            "train",
            *tiny_args(tiny_data, out),
            "-a",
            "resnet34",
            "--resume",
            out / "checkpoint.pt",
            "--epochs",
            "2",
        )
    )
    assert_user_error(result, "checkpoint.pt", "resnet18", "resnet34")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_resume_with_other_classes(data, tmp_path, one_rank_run):
    out = copy_run(one_rank_run, tmp_path / "run")  # trained on tiny_data, as `data` was
    for split in ("train", "val"):
        (data / split / "bar").rename(data / split / "box")
    result = timed(
        lambda: ddptrain("train", *tiny_args(data, out), "--resume", "auto", "--epochs", "2")
    )
    assert_user_error(result, "checkpoint-000000003.pt", "classes")  # the one auto chose


def test_batch_that_does_not_divide_under_torchrun(tiny_data, tmp_path):
    result = timed(lambda: torchrun(2, "train", *tiny_args(tiny_data, tmp_path), "-b", "7"))
    # torchrun adds its own report of the failed workers after ours.
    assert_user_error(result, "--batch-size 7", traceback_allowed=True)


def test_batch_that_does_not_divide_with_multiprocessing(tiny_data, tmp_path):
    result = timed(
        lambda: ddptrain(
            "train",
            *tiny_args(tiny_data, tmp_path),
            "-b",
            "7",
            "--multiprocessing-distributed",
            "--nproc-per-node",
            "2",
        )
    )
    assert_user_error(result, "--batch-size 7")


def test_one_failing_rank_ends_the_other(data, tmp_path):
    # The last val images belong to rank 1's shard only: rank 0 waits for it in the all-reduce.
    bad = data / "val" / "circle" / "00004.png"
    bad.write_bytes(b"\x89PNG broken")
    result = timed(
        lambda: ddptrain(
            "train",
            *tiny_args(data, tmp_path),
            "--multiprocessing-distributed",
            "--nproc-per-node",
            "2",
        )
    )
    assert_user_error(result, str(bad))
    assert not (tmp_path / "checkpoint.pt").exists()


@pytest.mark.serial  # timed against the 600 s the other rank used to wait
@pytest.mark.parametrize("failing", [0, 1])
def test_a_bad_device_on_one_tcp_rank_ends_both_before_the_group_forms(
    tiny_data, tmp_path, failing
):
    # No launcher ends the other invocation; --dist-timeout stays at its 600 s default.
    start = time.monotonic()
    bad = {failing: ("--device", "cuda")}  # no CUDA here
    results = tcp_pair("train", *tiny_args(tiny_data, tmp_path), rank_args=bad, timeout=120)
    # Seconds of work (two torch imports; 20 s with 5 processes busy on 2 cores), against the
    # 600 s the other rank waited before.
    assert time.monotonic() - start < 60
    assert_user_error(results[failing], "--device cuda: no cuda device is available here")
    other = results[1 - failing]
    needle = f"rank {failing}: --device cuda: no cuda device is available here (before the "
    assert_user_error(other, needle + "process group formed)")


def test_pretrained_weights_that_cannot_be_had_offline(tiny_data, tmp_path):
    # A proxy on a closed local port: the download fails at once, as on a machine with no network.
    offline = {"https_proxy": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9"}
    result = timed(
        lambda: ddptrain("train", *tiny_args(tiny_data, tmp_path), "--pretrained", env=offline)
    )
    assert_user_error(result, "--pretrained", "resnet18", "offline")


def test_a_fresh_run_does_not_overwrite_an_earlier_one(tiny_data, tmp_path, one_rank_run):
    out = copy_run(one_rank_run, tmp_path / "run")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    result = timed(lambda: ddptrain("train", *tiny_args(tiny_data, out)))
    assert_user_error(result, str(out), "--resume auto")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_unwritable_out_dir(tiny_data, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    result = timed(lambda: ddptrain("train", *tiny_args(tiny_data, blocker / "out")))
    assert_user_error(result, "--out-dir", str(blocker / "out"))


def test_arch_that_cannot_take_the_crop_size(tiny_data, tmp_path):
    result = timed(lambda: ddptrain("train", *tiny_args(tiny_data, tmp_path), "-a", "vit_b_32"))
    assert_user_error(result, "--arch vit_b_32", "16 px")


def test_resuming_another_checkpoint_into_a_used_out_dir(tiny_data, tmp_path):
    ok(ddptrain("train", *tiny_args(tiny_data, tmp_path / "a")))
    ok(ddptrain("train", *tiny_args(tiny_data, tmp_path / "b")))
    before = (tmp_path / "b" / "checkpoint.pt").read_bytes()
    result = timed(
        lambda: ddptrain(
            "train",
            *tiny_args(tiny_data, tmp_path / "b"),
            "--epochs",
            "2",
            "--resume",
            tmp_path / "a" / "checkpoint.pt",
        )
    )
    assert_user_error(result, str(tmp_path / "b"))
    assert (tmp_path / "b" / "checkpoint.pt").read_bytes() == before


def test_a_mid_epoch_checkpoint_needs_its_global_batch(tiny_data, tmp_path):
    ok(ddptrain("train", *tiny_args(tiny_data, tmp_path / "a"), "--checkpoint-every", "2"))
    mid_epoch = tmp_path / "a" / "checkpoint-000000002.pt"
    args = (*tiny_args(tiny_data, tmp_path / "b"), "-b", "12", "--resume", mid_epoch)
    result = timed(lambda: ddptrain("train", *args))
    assert_user_error(result, "--batch-size 12", "-b 8")
