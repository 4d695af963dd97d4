"""Sharded checkpoint folders in one process: numbering, retention, resume auto, convert, and
the files a user may hand over damaged or hostile."""

import os
import pickle
import re
import shutil

import pytest
import torch
import torchvision
from test_checkpoint import ONE, Crash, killed_at, meta, trained_model

from ddptrain.config import Config
from ddptrain.errors import UserError, WriteFailed
from ddptrain.state import files, sharded
from ddptrain.state.checkpointer import Checkpointer, TrainState, check_fits, training_parts
from ddptrain.state.resume import find_resume, roll_back
from ddptrain.train.optim import build_optimizer


def sharded_checkpointer(out_dir, model, optimizer, scheduler, keep_last=2):
    parts = training_parts(model, optimizer, scheduler, ONE)
    return Checkpointer(ONE, out_dir, parts, meta(), {}, keep_last, sharded_format=True)


@pytest.fixture
def saved(tmp_path):
    """A trained resnet18 saved sharded at global steps 10 and 20: (out_dir, model, optimizer)."""
    model, optimizer, scheduler = trained_model()
    saver = sharded_checkpointer(tmp_path, model, optimizer, scheduler)
    saver.save(TrainState(epoch=1, global_step=10))
    saver.save(TrainState(epoch=2, global_step=20, best_acc1=7.5), is_best=True)
    return tmp_path, model, optimizer


def test_a_save_is_a_numbered_folder_linked_and_retained(saved):
    out_dir, _, _ = saved
    model, optimizer, scheduler = trained_model()
    sharded_checkpointer(out_dir, model, optimizer, scheduler).save(TrainState(global_step=30))
    names = [p.name for p in files.numbered(out_dir)]
    assert names == ["checkpoint-000000030.dcp", "checkpoint-000000020.dcp"]  # keep_last 2
    assert os.readlink(out_dir / sharded.LATEST) == "checkpoint-000000030.dcp"
    assert (out_dir / sharded.BEST / sharded.STATE).is_file()
    assert not [p.name for p in out_dir.iterdir() if p.name.startswith(".")]


def test_a_save_in_the_other_format_retires_the_old_latest_link(saved):
    """A run resumed with another --checkpoint-format: checkpoint.pt stayed, naming an older
    step (and, as a hard link, keeping its space once retention removed it)."""
    out_dir, model, optimizer = saved
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 30)
    full = training_parts(model, optimizer, scheduler, ONE)
    Checkpointer(ONE, out_dir, full, meta(), {}, 2).save(TrainState(epoch=3, global_step=30))
    assert files.load(out_dir / "checkpoint.pt")["global_step"] == 30
    assert not (out_dir / "checkpoint.dcp").is_symlink()
    saver = sharded_checkpointer(out_dir, model, optimizer, scheduler)
    saver.save(TrainState(epoch=4, global_step=40))
    assert not (out_dir / "checkpoint.pt").exists()
    assert files.resolve("auto", out_dir) == out_dir / "checkpoint-000000040.dcp"


def test_going_back_to_an_earlier_folder_makes_it_the_newest_again(saved):
    out_dir, _, _ = saved
    removed = roll_back(out_dir, 10)
    assert [p.name for p in removed] == ["checkpoint-000000020.dcp"]
    assert [p.name for p in files.numbered(out_dir)] == ["checkpoint-000000010.dcp"]
    assert os.readlink(out_dir / sharded.LATEST) == "checkpoint-000000010.dcp"
    assert files.resolve("auto", out_dir).name == "checkpoint-000000010.dcp"
    assert roll_back(out_dir, 10) == []


@pytest.mark.parametrize("name", [sharded.BEST, "checkpoint-000000020.dcp"])
def test_a_folder_set_aside_by_a_crash_mid_swap_is_put_back(saved, name):
    # files.swap_in sets the folder it replaces aside, then renames the new one in: killed between.
    out_dir, _, _ = saved
    aside = out_dir / f".{name}.old"
    os.replace(out_dir / name, aside)
    # Back before --resume auto looks: else it resumes step 10, and roll_back deletes 20.
    assert find_resume("auto", out_dir, False, print).name == "checkpoint-000000020.dcp"
    assert (out_dir / name / sharded.STATE).is_file() and not aside.exists()


@pytest.mark.parametrize("ema", [False, True])
@pytest.mark.parametrize("crash_at", ["the checkpoint's rename", "the best copy's rename"])
def test_a_best_copy_is_committed_with_its_checkpoint_or_not_at_all(
    saved, monkeypatch, crash_at, ema
):
    """Killed (or interrupted) between the checkpoint's rename and its best copy's: the next
    start promotes the copy. Before the checkpoint's: both are gone."""
    out_dir, model, optimizer = saved
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 30)
    if ema:
        saver, _ = ema_checkpointer(out_dir, model, optimizer, scheduler)
    else:
        saver = sharded_checkpointer(out_dir, model, optimizer, scheduler)
    best_model = "model_ema" if ema else "model"
    state = TrainState(epoch=3, global_step=30, best_acc1=9.0, best_model=best_model)
    crash = files.swap_in if crash_at == "the checkpoint's rename" else files.promote
    with monkeypatch.context() as killed:
        killed.setattr(files, crash.__name__, lambda *args: killed_at(out_dir))
        with pytest.raises(Crash):
            saver.save(state, is_best=True)
    step = 30 if crash_at == "the best copy's rename" else 20
    for left in (out_dir, out_dir.with_name(f"{out_dir.name}-killed")):
        assert find_resume("auto", left, False, print).name == f"checkpoint-{step:09d}.dcp"
        best = sharded.to_single(left / sharded.BEST)
        assert best["global_step"] == step
        assert ("weights" in best) == (ema and step == 30)
        assert not [p.name for p in left.iterdir() if p.name.startswith(".")]


def test_a_best_copy_is_not_promoted_beside_an_earlier_save_of_its_step(saved):
    """Killed while a save replaced the folder of its own step (a restart's): the earlier
    folder, set aside, is put back, and the best copy pending for the save that did not
    commit is not taken for that folder's."""
    out_dir, _, _ = saved
    pending = files.pending_best(out_dir / sharded.BEST, 20)
    shutil.copytree(out_dir / "checkpoint-000000010.dcp", pending)  # not step 20's
    os.replace(out_dir / "checkpoint-000000020.dcp", out_dir / ".checkpoint-000000020.dcp.old")
    assert find_resume("auto", out_dir, False, print).name == "checkpoint-000000020.dcp"
    assert files.load(out_dir / sharded.BEST)["global_step"] == 20
    assert not [p.name for p in out_dir.iterdir() if p.name.startswith(".")]


def test_a_runs_out_dir_given_as_a_checkpoint_is_named_so(saved):
    out_dir, _, _ = saved
    with pytest.raises(UserError, match="is a run's out-dir, not a checkpoint.*000000020.dcp"):
        files.load(out_dir)


def test_restore_and_convert_give_back_what_was_saved(saved):
    out_dir, model, optimizer = saved
    resume = files.resolve("auto", out_dir)
    assert resume.name == "checkpoint-000000020.dcp"
    fresh = torchvision.models.get_model("resnet18", num_classes=3)
    fresh_optimizer, fresh_scheduler = build_optimizer(fresh, Config(lr=0.1).optim)
    restorer = sharded_checkpointer(out_dir, fresh, fresh_optimizer, fresh_scheduler)
    state = restorer.restore(files.load(resume))
    assert (state.epoch, state.global_step, state.best_acc1) == (2, 20, 7.5)
    for key, value in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value), key
    momentum = {k: v["momentum_buffer"] for k, v in optimizer.state_dict()["state"].items()}
    restored = fresh_optimizer.state_dict()["state"]
    assert all(torch.equal(restored[k]["momentum_buffer"], v) for k, v in momentum.items())
    single = sharded.convert(resume, out_dir / "one.pt")
    loaded = files.load(out_dir / "one.pt")
    assert loaded["global_step"] == single["global_step"] == 20
    assert all(torch.equal(loaded["model"][k], v) for k, v in model.state_dict().items())
    assert loaded["optimizer"]["param_groups"][0]["lr"] == optimizer.param_groups[0]["lr"]


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda f: (f / "__0_0.distcp").unlink(), "its shard __0_0.distcp is missing"),
        (lambda f: os.truncate(f / "__0_0.distcp", 100), "its shard __0_0.distcp is truncated"),
        (lambda f: (f / ".metadata").unlink(), "its .metadata is missing"),
        (lambda f: (f / "state.pt").unlink(), "its state.pt is missing"),
        (lambda f: (f / ".metadata").write_bytes(b"not a pickle"), ".metadata is damaged"),
    ],
)
def test_a_damaged_folder_is_named_and_resume_auto_falls_back(saved, damage, message):
    out_dir, _, _ = saved
    newest = out_dir / "checkpoint-000000020.dcp"
    damage(newest)
    with pytest.raises(UserError, match=message):
        files.load(newest)
    skipped = []
    assert files.resolve("auto", out_dir, skipped.append).name == "checkpoint-000000010.dcp"
    (warning,) = skipped
    assert f"skips a checkpoint: {newest}" in warning


def test_a_folder_of_a_later_format_is_refused_not_skipped(saved):
    out_dir, _, _ = saved
    folder = out_dir / "checkpoint-000000020.dcp"
    state = torch.load(folder / sharded.STATE, weights_only=True)
    torch.save({**state, "format_version": files.FORMAT_VERSION + 1}, folder / sharded.STATE)
    with pytest.raises(files.NewerFormat, match=f"{folder} was written by a newer ddptrain"):
        files.load(folder)
    with pytest.raises(files.NewerFormat):
        files.resolve("auto", out_dir)


class _Planted:
    def __reduce__(self):
        return (os.mkdir, (MARKER,))


# One per process: `make test` runs two test processes at once, and the last test here makes it.
MARKER = f"/tmp/ddptrain-sharded-metadata-ran-code-{os.getpid()}"


def _text(text: str) -> bytes:  # pickle's SHORT_BINUNICODE
    return b"\x8c" + bytes([len(text)]) + text.encode()


# os.mkdir(MARKER) reached through the metadata module's own import of os: a protocol 4
# STACK_GLOBAL of a dotted name (PROTO 4, module, name, STACK_GLOBAL, arg, TUPLE1, REDUCE, STOP).
_THROUGH_THE_METADATA_MODULE = (
    b"\x80\x04"
    + _text("torch.distributed.checkpoint.metadata")
    + _text("os.mkdir")
    + b"\x93"
    + _text(MARKER)
    + b"\x85R."
)


@pytest.mark.parametrize(
    "payload, named",
    [
        (pickle.dumps(_Planted()), "posix.mkdir"),
        (_THROUGH_THE_METADATA_MODULE, "torch.distributed.checkpoint.metadata.os.mkdir"),
    ],
    ids=["a function", "a function through an allowed module"],
)
def test_metadata_that_would_run_code_is_refused(saved, payload, named):
    out_dir, _, _ = saved
    folder = out_dir / "checkpoint-000000020.dcp"
    shutil.rmtree(MARKER, ignore_errors=True)
    (folder / ".metadata").write_bytes(payload)
    with pytest.raises(UserError, match=f"refers to {re.escape(named)}.*never code"):
        files.load(folder)
    assert not os.path.exists(MARKER)


def test_the_dotted_payload_does_run_when_unpickled():
    # The test's own check: plain pickle runs it.
    shutil.rmtree(MARKER, ignore_errors=True)
    pickle.loads(_THROUGH_THE_METADATA_MODULE)
    assert os.path.exists(MARKER)
    os.rmdir(MARKER)


def test_a_folder_of_another_arch_is_named_before_loading(saved):
    out_dir, _, _ = saved
    folder = out_dir / "checkpoint-000000020.dcp"
    other = torchvision.models.get_model("resnet34", num_classes=3)
    with pytest.raises(UserError, match="does not fit this model: missing layer1.2"):
        check_fits(files.load(folder), folder, other)
    check_fits(files.load(folder), folder, trained_model()[0])  # its own arch fits


def test_convert_names_what_it_cannot_take(saved, tmp_path):
    out_dir, _, _ = saved
    with pytest.raises(UserError, match="is not a sharded checkpoint folder"):
        sharded.convert(out_dir / "nothing", tmp_path / "x.pt")
    with pytest.raises(UserError, match="must end in .pt"):
        sharded.convert(out_dir / "checkpoint-000000020.dcp", tmp_path / "x.bin")


@pytest.mark.parametrize("name", ["state.pt", "model_best.dcp"])
def test_a_full_disk_while_committing_is_one_line_and_leaves_no_temp_folder(
    saved, monkeypatch, name
):
    out_dir, model, optimizer = saved
    monkeypatch.setenv("DDPTRAIN_TEST_ENOSPC", name)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 30)
    saver = sharded_checkpointer(out_dir, model, optimizer, scheduler)
    with pytest.raises(WriteFailed, match=f"{name}: No space left on device") as failed:
        saver.save(TrainState(epoch=3, global_step=30, best_acc1=9.0), is_best=True)
    assert "free" in str(failed.value) and "--resume auto" in str(failed.value)
    assert "\n" not in str(failed.value)
    assert not [p.name for p in out_dir.iterdir() if p.name.startswith(".")]
    assert files.load(out_dir / "model_best.dcp")["global_step"] == 20  # the earlier best
    # Nothing of the failed save is committed, its best copy with it (files.save says why).
    assert files.resolve("auto", out_dir) == out_dir / "checkpoint-000000020.dcp"


def ema_checkpointer(out_dir, model, optimizer, scheduler):
    from ddptrain.train.ema import ModelEma

    ema = ModelEma(model, ONE, decay=0.5)
    ema.update(model, 1)  # the first update copies the weights
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # the raw weights move on: the average is now another model
    ema.update(model, 2)
    saver = sharded_checkpointer(out_dir, model, optimizer, scheduler)
    saver.parts["model_ema"] = ema
    return saver, ema


def test_when_the_ema_scored_best_model_best_holds_its_weights(tmp_path):
    model, optimizer, scheduler = trained_model()
    saver, ema = ema_checkpointer(tmp_path, model, optimizer, scheduler)
    state = TrainState(epoch=1, global_step=10, best_acc1=9.0, best_model="model_ema")
    saver.save(state, is_best=True)
    best = sharded.to_single(tmp_path / sharded.BEST)
    assert best["weights"] == "model_ema" and best["best_model"] == "model_ema"
    for name, tensor in ema.module.state_dict().items():
        assert best["model"][name].equal(tensor), name
    raw = sharded.to_single(tmp_path / "checkpoint-000000010.dcp")
    assert "weights" not in raw
    assert not raw["model"]["fc.weight"].equal(best["model"]["fc.weight"])
    assert raw["model"]["fc.weight"].equal(model.state_dict()["fc.weight"])
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_the_ema_is_written_as_shards_and_restored_from_them(tmp_path):
    model, optimizer, scheduler = trained_model()
    saver, ema = ema_checkpointer(tmp_path, model, optimizer, scheduler)
    saver.save(TrainState(epoch=1, global_step=10))
    folder = tmp_path / "checkpoint-000000010.dcp"
    assert "model_ema" not in files.safe_load(folder / sharded.STATE, "state")
    assert files.resolve("auto", tmp_path) == folder  # --resume auto reads past the EMA's shards
    assert_restores(ema, folder)
    assert sharded.to_single(folder)["model_ema"]["updates"] == 2


def test_a_folder_with_the_ema_in_its_state_file_still_restores(tmp_path, monkeypatch):
    """As folders were written before the EMA's weights went into the shards."""
    model, optimizer, scheduler = trained_model()
    saver, ema = ema_checkpointer(tmp_path, model, optimizer, scheduler)
    with monkeypatch.context() as earlier:
        earlier.setattr(sharded, "SHARDED_PARTS", ("model", "optimizer"))
        saver.save(TrainState(epoch=1, global_step=10))
    folder = tmp_path / "checkpoint-000000010.dcp"
    assert "model_ema" in files.safe_load(folder / sharded.STATE, "state")
    assert_restores(ema, folder)


def assert_restores(ema, folder):
    """The EMA saved in `folder`, restored into another EMA, is `ema` again."""
    model, optimizer, scheduler = trained_model()
    restorer, other = ema_checkpointer(folder.parent, model, optimizer, scheduler)
    other.updates = 0
    with torch.no_grad():
        for tensor in (*other.module.parameters(), *other.module.buffers()):
            tensor.add_(1)  # another average, BatchNorm statistics included, before the restore
    restorer.restore(sharded.read(folder))
    assert other.updates == ema.updates == 2
    for name, tensor in ema.module.state_dict().items():
        assert other.module.state_dict()[name].equal(tensor), name


def test_an_ema_with_non_finite_weights_is_not_saved(tmp_path):
    model, optimizer, scheduler = trained_model()
    saver, ema = ema_checkpointer(tmp_path, model, optimizer, scheduler)
    with torch.no_grad():
        ema.module.fc.bias[0] = float("nan")
    with pytest.raises(UserError, match="not finite at global step 10"):
        saver.save(TrainState(epoch=1, global_step=10))
    assert not files.numbered(tmp_path)


def test_a_full_disk_on_an_ema_best_leaves_the_earlier_best(saved, monkeypatch):
    out_dir, model, optimizer = saved
    monkeypatch.setenv("DDPTRAIN_TEST_ENOSPC", "model_best.dcp")
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 30)
    saver, _ = ema_checkpointer(out_dir, model, optimizer, scheduler)
    state = TrainState(epoch=3, global_step=30, best_acc1=9.0, best_model="model_ema")
    with pytest.raises(WriteFailed, match="model_best.dcp: No space left on device"):
        saver.save(state, is_best=True)
    assert not [p.name for p in out_dir.iterdir() if p.name.startswith(".")]
    assert files.load(out_dir / "model_best.dcp")["global_step"] == 20
    assert files.resolve("auto", out_dir) == out_dir / "checkpoint-000000020.dcp"


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs Linux's /dev/full")
def test_a_shard_the_disk_cannot_take_is_one_line_and_leaves_the_earlier_checkpoints(
    saved, monkeypatch
):
    """A real ENOSPC from the kernel inside DCP's own write (the shard file is /dev/full), which
    DCP hands back as a CheckpointException, not an Exception."""
    out_dir, model, optimizer = saved
    prepare = sharded.prepare

    def prepare_onto_a_full_disk(out_dir, global_step, best_apart=False):
        prepare(out_dir, global_step, best_apart)
        shard = sharded.temp_folder(out_dir, global_step) / "__0_0.distcp"
        os.symlink("/dev/full", shard)

    monkeypatch.setattr(sharded, "prepare", prepare_onto_a_full_disk)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 30)
    saver = sharded_checkpointer(out_dir, model, optimizer, scheduler)
    with pytest.raises(WriteFailed) as failed:
        saver.save(TrainState(epoch=3, global_step=30))
    message = str(failed.value)
    needed = r"\.checkpoint-000000030\.dcp\.tmp: No space left on device \(it needs [\d.]+ MiB, "
    assert re.search(needed, message), message
    assert "free)" in message and "--resume auto" in message and "\n" not in message
    assert not [p.name for p in out_dir.iterdir() if p.name.startswith(".")]
    assert files.resolve("auto", out_dir) == out_dir / "checkpoint-000000020.dcp"


def flip_a_bit(path, where):
    """One bit flipped at a fraction of the file, or in the first occurrence of some bytes
    (torch.save's padding between records has no CRC)."""
    data = bytearray(path.read_bytes())
    data[data.index(where) if isinstance(where, bytes) else int(len(data) * where)] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda f: flip_a_bit(f / "__0_0.distcp", 0.5), "checksum mismatch in its shard __0_0"),
        (
            lambda f: (f / "__0_0.distcp").write_bytes(bytes((f / "__0_0.distcp").stat().st_size)),
            "its shard __0_0.distcp \\(File is not a zip file\\)",
        ),
        (
            lambda f: flip_a_bit(f / "state.pt", b"best_acc1"),
            "state.pt is damaged: checksum mismatch",
        ),
    ],
    ids=["flipped-bit-in-a-shard", "zeroed-shard", "flipped-bit-in-state"],
)
def test_damaged_bytes_in_a_folder_are_found_before_loading(saved, damage, message, tmp_path):
    """DCP's load checks no CRC: a flipped bit in tensor data loaded silently, and a shard that
    failed only inside the collective load stopped --resume auto instead of falling back."""
    out_dir, _, _ = saved
    newest = out_dir / "checkpoint-000000020.dcp"
    sharded.verify(newest)  # whole: nothing to say
    damage(newest)
    with pytest.raises(UserError, match=message):
        files.resolve(str(newest), out_dir)  # --resume PATH: before any rank loads it
    skipped = []
    assert files.resolve("auto", out_dir, skipped.append).name == "checkpoint-000000010.dcp"
    assert re.search(message, skipped[0]) and str(newest) in skipped[0]
    with pytest.raises(UserError, match=message):
        sharded.convert(newest, tmp_path / "c.pt")
    assert not (tmp_path / "c.pt").exists()


def test_convert_refuses_to_write_into_its_source(saved):
    out_dir, _, _ = saved
    folder = out_dir / "checkpoint-000000020.dcp"
    before = (folder / "state.pt").read_bytes()
    with pytest.raises(UserError, match="lies inside SRC"):
        sharded.convert(folder, folder / "state.pt")
    assert (folder / "state.pt").read_bytes() == before


def test_a_shard_overwritten_with_other_bytes_is_named_as_damaged(saved):
    out_dir, _, _ = saved
    folder = out_dir / "checkpoint-000000020.dcp"
    shard = folder / "__0_0.distcp"
    shard.write_bytes(bytes(shard.stat().st_size))  # the same length, all zeros
    with pytest.raises(UserError, match=r"000020.dcp is damaged: its shards cannot be read \("):
        sharded.to_single(folder)
    fresh = torchvision.models.get_model("resnet18", num_classes=3)
    fresh_optimizer, fresh_scheduler = build_optimizer(fresh, Config(lr=0.1).optim)
    restorer = sharded_checkpointer(out_dir, fresh, fresh_optimizer, fresh_scheduler)
    with pytest.raises(UserError, match="is damaged: its shards cannot be read"):
        restorer.restore(files.load(folder))
