"""Files whose unpickling would run code, fed to every command that opens a file: nothing runs,
and the user gets one clear line."""

import io
import os
import pickle
import shutil
import zipfile
from pathlib import Path

import pytest
import torch
import torchvision
from cli import copy_run, ddptrain, ok, tiny_args
from test_user_errors import assert_user_error, timed


class _Payload:
    """Unpickling this creates `marker`: proof that code ran."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def _saved_with_torch(path: Path, marker: Path) -> Path:
    """A torch.save file whose data.pkl carries the payload in an otherwise ordinary checkpoint."""
    torch.save({"model": {"fc.weight": torch.zeros(1)}, "arch": _Payload(marker)}, path)
    return path


def _handmade_zip(path: Path, marker: Path) -> Path:
    """A zip laid out as torch.save's (valid CRCs, so integrity checks pass) whose data.pkl is a
    bare payload."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr("archive/data.pkl", pickle.dumps(_Payload(marker), protocol=2))
        archive.writestr("archive/byteorder", "little")
        archive.writestr("archive/version", "3\n")
    return path


def _plain_pickle(path: Path, marker: Path) -> Path:
    path.write_bytes(pickle.dumps({"model": _Payload(marker)}))
    return path


def _legacy_torch_save(path: Path, marker: Path) -> Path:
    buffer = io.BytesIO()
    torch.save({"model": _Payload(marker)}, buffer, _use_new_zipfile_serialization=False)
    path.write_bytes(buffer.getvalue())
    return path


HOSTILE = [_saved_with_torch, _handmade_zip, _plain_pickle, _legacy_torch_save]


def _nothing_ran(marker: Path) -> None:
    assert not marker.exists(), "the hostile file's code ran"


def _refused_in_one_line(result, *needles) -> None:
    assert_user_error(result, *needles)
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "weights_only" not in result.stderr  # torch's advice to load it unsafely


def test_the_payloads_do_run_when_unpickled(tmp_path):
    # The test's own check: each hostile file really would run code if unpickled unsafely.
    for i, make in enumerate(HOSTILE):
        marker = tmp_path / f"ran-{i}"
        path = make(tmp_path / f"hostile-{i}.pt", marker)
        if make is _plain_pickle:
            pickle.loads(path.read_bytes())
        else:
            torch.load(path, weights_only=False)
        assert marker.exists(), make.__name__


@pytest.mark.parametrize("make", HOSTILE, ids=lambda f: f.__name__.strip("_"))
@pytest.mark.parametrize("command", ["train", "eval"])
def test_resume_from_a_hostile_checkpoint(tiny_data, tmp_path, command, make):
    marker = tmp_path / "ran"
    hostile = make(tmp_path / "hostile.pt", marker)
    out = tmp_path / "out"
    result = timed(lambda: ddptrain(command, *tiny_args(tiny_data, out), "--resume", hostile))
    _refused_in_one_line(result, "--resume", str(hostile))
    _nothing_ran(marker)


@pytest.mark.parametrize("make", [_saved_with_torch, _handmade_zip], ids=["torch", "zip"])
@pytest.mark.parametrize("command", ["export", "pretrained"])
def test_export_and_pretrained_never_run_a_hostile_file(tiny_data, tmp_path, command, make):
    marker = tmp_path / "ran"
    hostile = make(tmp_path / "hostile.pt", marker)
    if command == "export":
        result = timed(lambda: ddptrain("export", hostile, "--out", tmp_path / "w.safetensors"))
    else:
        args = (*tiny_args(tiny_data, tmp_path / "out"), "--pretrained", hostile)
        result = timed(lambda: ddptrain("train", *args))
    _refused_in_one_line(result, str(hostile))
    _nothing_ran(marker)


def test_resume_auto_never_runs_a_planted_checkpoint(tiny_data, tmp_path, one_rank_run):
    out, marker = copy_run(one_rank_run, tmp_path / "out"), tmp_path / "ran"
    planted = _saved_with_torch(out / "checkpoint-000000099.pt", marker)
    result = timed(
        lambda: ddptrain("train", *tiny_args(tiny_data, out), "--epochs", "2", "--resume", "auto")
    )
    ok(result)  # the planted file is skipped with a warning naming it; the real one resumes
    assert str(planted) in result.stderr and "warning" in result.stderr
    _nothing_ran(marker)


def _hub_cache_file(arch: str) -> Path:
    url = torchvision.models.get_model_weights(arch).DEFAULT.url
    return Path(os.environ["TORCH_HOME"]) / "hub" / "checkpoints" / Path(url).name


@pytest.mark.parametrize("make", HOSTILE, ids=lambda f: f.__name__.strip("_"))
def test_pretrained_never_runs_a_file_planted_in_the_hub_cache(tiny_data, tmp_path, make):
    marker = tmp_path / "ran"
    planted = _hub_cache_file("resnet18")
    planted.parent.mkdir(parents=True, exist_ok=True)
    make(planted, marker)
    try:
        result = timed(lambda: ddptrain("train", *tiny_args(tiny_data, tmp_path), "--pretrained"))
        _refused_in_one_line(result, "--pretrained", str(planted), "hash")
        _nothing_ran(marker)
    finally:
        planted.unlink()


def test_resume_auto_with_only_a_planted_checkpoint_is_refused(tiny_data, tmp_path):
    out, marker = tmp_path / "out", tmp_path / "ran"
    out.mkdir()
    planted = _handmade_zip(out / "checkpoint-000000003.pt", marker)
    result = timed(lambda: ddptrain("train", *tiny_args(tiny_data, out), "--resume", "auto"))
    assert_user_error(result, "--resume auto", "no usable checkpoint", planted.name)
    assert f"skips a checkpoint: {planted}" in result.stderr
    _nothing_ran(marker)


@pytest.fixture(scope="module")
def sharded_run(tiny_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("sharded")
    ok(ddptrain("train", *tiny_args(tiny_data, out), "--checkpoint-format", "sharded"))
    return out / "checkpoint-000000003.dcp"


def _hostile_metadata(folder: Path, marker: Path) -> None:
    (folder / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))


def _hostile_state(folder: Path, marker: Path) -> None:
    _saved_with_torch(folder / "state.pt", marker)


@pytest.mark.parametrize("plant", [_hostile_metadata, _hostile_state], ids=["metadata", "state"])
@pytest.mark.parametrize("command", ["convert", "eval", "export"])
def test_a_hostile_sharded_folder_never_runs(tiny_data, tmp_path, sharded_run, command, plant):
    marker, folder = tmp_path / "ran", tmp_path / "hostile.dcp"
    shutil.copytree(sharded_run, folder)
    plant(folder, marker)
    if command == "convert":
        result = timed(lambda: ddptrain("convert", folder, tmp_path / "one.pt"))
    elif command == "export":
        result = timed(lambda: ddptrain("export", folder, "--out", tmp_path / "w.safetensors"))
    else:
        result = timed(
            lambda: ddptrain("eval", *tiny_args(tiny_data, tmp_path), "--resume", folder)
        )
    _refused_in_one_line(result, str(folder), "never code")
    _nothing_ran(marker)
    assert not (tmp_path / "one.pt").exists() and not (tmp_path / "w.safetensors").exists()
