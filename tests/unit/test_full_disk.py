"""A full disk (or any I/O error) while writing: one line naming the file and the space it
needs, the files written before intact, no temp file left behind."""

import errno
import json
import os
import shutil
from collections import namedtuple

import pytest
import torch
import torchvision

from ddptrain.config import Config
from ddptrain.data import synth
from ddptrain.distributed.env import DistEnv
from ddptrain.errors import UserError, WriteFailed
from ddptrain.report.metrics import MetricsLog
from ddptrain.state import files
from ddptrain.state.checkpointer import Checkpointer, TrainState, training_parts
from ddptrain.train.optim import build_optimizer

META = {"arch": "resnet18", "num_classes": 3, "class_to_idx": {"a": 0, "b": 1, "c": 2}}
Usage = namedtuple("Usage", "total used free")


def model_and_optimizer():
    torch.manual_seed(0)
    model = torchvision.models.get_model("resnet18", num_classes=3)
    optimizer, scheduler = build_optimizer(model, Config(lr=0.1).optim)
    model(torch.randn(2, 3, 32, 32)).logsumexp(1).mean().backward()
    optimizer.step()  # SGD momentum: one buffer a parameter
    return model, optimizer, scheduler


ONE = DistEnv(0, 1, 0, 1, torch.device("cpu"))


def save_step(out_dir, step, is_best=False):
    model, optimizer, scheduler = model_and_optimizer()
    state = TrainState(epoch=step, global_step=step)
    parts = training_parts(model, optimizer, scheduler, ONE)
    checkpoint = Checkpointer(ONE, out_dir, parts, META, {}, 2).gather(state)
    files.save(out_dir, checkpoint, is_best, 2)


def full_disk_at_fsync(monkeypatch):
    def no_space(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", no_space)


def full_disk_mid_write(monkeypatch):
    """The file object's write puts half its bytes on disk, then finds the disk full."""
    real_fdopen = os.fdopen

    class HalfWritten:
        def __init__(self, f):
            self.f = f

        def write(self, data):
            self.f.write(data[: len(data) // 2])
            self.f.flush()
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    monkeypatch.setattr(os, "fdopen", lambda *a, **k: HalfWritten(real_fdopen(*a, **k)))


def full_disk_by_fault_injection(monkeypatch):
    monkeypatch.setenv("DDPTRAIN_TEST_ENOSPC", "checkpoint-0000000*")


@pytest.mark.parametrize(
    "fill_disk", [full_disk_at_fsync, full_disk_mid_write, full_disk_by_fault_injection]
)
def test_a_full_disk_while_saving_leaves_the_previous_checkpoint_and_no_temp_file(
    tmp_path, monkeypatch, fill_disk
):
    save_step(tmp_path, 3, is_best=True)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    fill_disk(monkeypatch)
    with pytest.raises(UserError) as raised:
        save_step(tmp_path, 6, is_best=True)
    monkeypatch.undo()

    message = str(raised.value)
    assert isinstance(raised.value, WriteFailed) and "\n" not in message
    assert f"cannot write {tmp_path / 'checkpoint-000000006.pt'}: No space left" in message
    size = (tmp_path / "checkpoint.pt").stat().st_size  # the same model: the same size
    assert f"it needs {size / 2**20:.1f} MiB, {tmp_path} has " in message
    assert "free" in message and "--resume auto" in message
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # no temp file
    assert files.resolve("auto", tmp_path) == tmp_path / "checkpoint-000000003.pt"
    assert files.load(tmp_path / "checkpoint.pt")["global_step"] == 3


def test_a_full_disk_while_writing_model_best_commits_neither(tmp_path, monkeypatch):
    """A checkpoint committed without its best copy carried the raised best_acc1 on to every
    resume, which then never wrote model_best.pt again."""
    save_step(tmp_path, 3, is_best=True)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    monkeypatch.setenv("DDPTRAIN_TEST_ENOSPC", "model_best.pt")
    with pytest.raises(WriteFailed, match="model_best.pt: No space left on device"):
        save_step(tmp_path, 6, is_best=True)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # no temp file
    assert files.resolve("auto", tmp_path) == tmp_path / "checkpoint-000000003.pt"


def test_an_io_error_other_than_a_full_disk_names_the_file(tmp_path, monkeypatch):
    def broken(*args):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "replace", broken)
    with pytest.raises(WriteFailed, match=r"config.json: Input/output error \(it needs 2 B"):
        files.atomic_write(tmp_path / "config.json", b"{}")
    assert list(tmp_path.iterdir()) == []


def test_a_full_disk_while_writing_config_json_keeps_the_old_one(tmp_path, monkeypatch):
    files.atomic_write(tmp_path / "config.json", b'{"epochs": 1}')
    monkeypatch.setenv("DDPTRAIN_TEST_ENOSPC", "config.json")
    with pytest.raises(WriteFailed, match="config.json: No space left on device"):
        files.atomic_write(tmp_path / "config.json", b'{"epochs": 2}')
    assert [p.name for p in tmp_path.iterdir()] == ["config.json"]
    assert (tmp_path / "config.json").read_bytes() == b'{"epochs": 1}'


def test_a_full_disk_while_appending_metrics_takes_back_the_partial_line(tmp_path, monkeypatch):
    log = MetricsLog(tmp_path, enabled=True)
    log.write({"split": "train", "epoch": 1})
    before = log.path.read_bytes()
    monkeypatch.setenv("DDPTRAIN_TEST_ENOSPC", "metrics.jsonl")  # fails once the line is written
    with pytest.raises(WriteFailed, match="metrics.jsonl: No space left on device"):
        log.write({"split": "val", "epoch": 1})
    assert log.path.read_bytes() == before
    assert [json.loads(line) for line in before.splitlines()] == [{"split": "train", "epoch": 1}]


def test_a_full_disk_while_writing_the_builtin_dataset_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("DDPTRAIN_TEST_ENOSPC", "00003.png")
    spec = synth.SynthSpec(classes=2, train_per_class=4, val_per_class=1, size=16)
    with pytest.raises(WriteFailed, match="No space left on device") as raised:
        synth.ensure_builtin(spec, log=False)
    assert "the built-in dataset: cannot write" in str(raised.value)
    assert "XDG_CACHE_HOME" in str(raised.value) and "free" in str(raised.value)
    assert [p.name for p in (tmp_path / "ddptrain").iterdir() if not p.name.endswith(".lock")] == []
    with pytest.raises(WriteFailed, match=f"cannot write {tmp_path / 'tree'}: No space"):
        synth.write(spec, tmp_path / "tree")
    assert not any(p.name.startswith((".tree", "tree")) for p in tmp_path.iterdir())


def test_the_checkpoint_size_estimate_is_close_to_a_real_checkpoint(tmp_path):
    save_step(tmp_path, 1)
    real = (tmp_path / "checkpoint.pt").stat().st_size
    estimate = files.checkpoint_bytes(*model_and_optimizer()[:2])
    assert abs(estimate - real) / real < 0.05, (estimate, real)


def test_no_room_for_the_kept_checkpoints_warns_in_one_line(tmp_path, monkeypatch):
    size = 10 * 2**20
    needed = (2 + files.PEAK_EXTRA_CHECKPOINTS) * size
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(0, 0, needed))
    assert files.room_warning(tmp_path, size, keep_last=2) is None
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(0, 0, needed - 1))
    warning = files.room_warning(tmp_path, size, keep_last=2)
    assert "\n" not in warning and warning.startswith(f"--out-dir {tmp_path} has")
    assert "need up to 50.0 MiB (--keep-last 2" in warning and "10.0 MiB each" in warning


def test_checkpoints_already_in_the_out_dir_count_as_room(tmp_path, monkeypatch):
    save_step(tmp_path, 1)  # checkpoint-000000001.pt and its hard link checkpoint.pt
    size = (tmp_path / "checkpoint.pt").stat().st_size
    needed = (1 + files.PEAK_EXTRA_CHECKPOINTS) * size
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(0, 0, needed - size))
    assert files.room_warning(tmp_path, size, keep_last=1) is None
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(0, 0, needed - size - 1))
    assert files.room_warning(tmp_path, size, keep_last=1)  # the link is not counted twice


def test_sharded_checkpoints_in_the_out_dir_count_as_room_by_their_contents(tmp_path, monkeypatch):
    from test_sharded_files import sharded_checkpointer

    from ddptrain.state.checkpointer import TrainState

    model, optimizer, scheduler = model_and_optimizer()
    saver = sharded_checkpointer(tmp_path, model, optimizer, scheduler, keep_last=1)
    saver.save(TrainState(global_step=1), is_best=True)  # the folder, its link, model_best.dcp
    size = files.folder_bytes(tmp_path / "checkpoint-000000001.dcp")
    assert size > 10 * (tmp_path / "checkpoint-000000001.dcp").stat().st_size
    # model_best.dcp's files are hard links to the folder's: the same bytes, counted once.
    shard = next((tmp_path / "checkpoint-000000001.dcp").glob("*.distcp"))
    assert (tmp_path / "model_best.dcp" / shard.name).samefile(shard)
    held = size
    needed = (1 + files.PEAK_EXTRA_CHECKPOINTS) * size
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(0, 0, needed - held))
    assert files.room_warning(tmp_path, size, keep_last=1) is None
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(0, 0, needed - held - 1))
    assert files.room_warning(tmp_path, size, keep_last=1)  # the link is not counted twice
