import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
import torchvision
from torch import nn

from ddptrain import cli, faults
from ddptrain.config import Config
from ddptrain.config_layers import resumed
from ddptrain.distributed.env import DistEnv
from ddptrain.errors import UserError
from ddptrain.parallel.parallelize import unwrap
from ddptrain.state import files, sharded
from ddptrain.state.checkpointer import (
    FORMAT_VERSION,
    Checkpointer,
    TrainState,
    check_compatible,
    check_fits,
    training_parts,
)
from ddptrain.state.resume import (
    check_continuable,
    check_out_dir,
    check_same_leave_out,
    find_resume,
    roll_back,
)
from ddptrain.train.optim import build_optimizer

CLASSES = {"a": 0, "b": 1, "c": 2}
ONE = DistEnv(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"))


def trained_model():
    torch.manual_seed(0)
    model = torchvision.models.get_model("resnet18", num_classes=3)
    optimizer, scheduler = build_optimizer(model, Config(lr=0.1).optim)
    loss = model(torch.randn(4, 3, 32, 32)).logsumexp(1).mean()
    loss.backward()
    optimizer.step()
    scheduler.step()
    return model, optimizer, scheduler


def meta():
    return {"arch": "resnet18", "num_classes": 3, "class_to_idx": CLASSES, "config": {}}


def checkpointer(out_dir, model, optimizer, scheduler, scaler=None, keep_last=2):
    parts = training_parts(model, optimizer, scheduler, ONE, scaler)
    return Checkpointer(ONE, out_dir, parts, meta(), {}, keep_last)


def gathered(model, optimizer, scheduler, state, scaler=None):
    """What the Checkpointer writes for state."""
    return checkpointer(None, model, optimizer, scheduler, scaler).gather(state)


def test_round_trip_restores_weights_optimizer_schedule_and_state(tmp_path):
    model, optimizer, scheduler = trained_model()
    state = TrainState(epoch=3, global_step=30, best_acc1=42.5)
    payload = gathered(model, optimizer, scheduler, state)
    files.save(tmp_path, payload, True, keep_last=2)

    saved = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    assert saved["format_version"] == FORMAT_VERSION
    assert (tmp_path / "model_best.pt").read_bytes() == (tmp_path / "checkpoint.pt").read_bytes()
    fresh = torchvision.models.get_model("resnet18", num_classes=3)
    fresh_opt, fresh_sched = build_optimizer(fresh, Config(lr=0.1).optim)
    saved = files.load(tmp_path / "checkpoint.pt")
    restored = checkpointer(tmp_path, fresh, fresh_opt, fresh_sched).restore(saved)

    assert restored == state
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    momentum = [optimizer.state[p]["momentum_buffer"] for p in model.parameters()]
    fresh_momentum = [fresh_opt.state[p]["momentum_buffer"] for p in fresh.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(momentum, fresh_momentum, strict=True))
    assert fresh_sched.state_dict() == scheduler.state_dict()


def test_when_the_average_scored_best_model_best_holds_its_weights(tmp_path):
    raw = {"w": torch.zeros(2)}
    averaged = {"w": torch.ones(2)}
    payload = {"model": raw, "model_ema": {"model": averaged, "updates": 3}, "global_step": 3}
    files.save(tmp_path, {**payload, "best_model": "model_ema"}, True, keep_last=2)

    best, latest = files.load(tmp_path / "model_best.pt"), files.load(tmp_path / "checkpoint.pt")
    assert torch.equal(best["model"]["w"], averaged["w"]) and best["weights"] == "model_ema"
    assert torch.equal(latest["model"]["w"], raw["w"]) and "weights" not in latest  # resumes


def test_saved_keys_have_no_wrapper_prefix_and_load_strictly(tmp_path):
    model, optimizer, scheduler = trained_model()
    wrapped = nn.DataParallel(model)  # a wrapper that adds `module.` on CPU too
    payload = gathered(unwrap(wrapped), optimizer, scheduler, TrainState())
    assert not any(k.startswith(("module.", "_orig_mod.")) for k in payload["model"])
    assert all(v.device.type == "cpu" for v in payload["model"].values())
    torchvision.models.get_model("resnet18", num_classes=3).load_state_dict(payload["model"])


def test_failed_save_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    model, optimizer, scheduler = trained_model()
    files.save(
        tmp_path,
        gathered(model, optimizer, scheduler, TrainState(epoch=1)),
        False,
        keep_last=2,
    )
    before = (tmp_path / "checkpoint.pt").read_bytes()

    def crash(*args):
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", crash)
    with pytest.raises(OSError, match="disk full"):
        files.save(
            tmp_path,
            gathered(model, optimizer, scheduler, TrainState(epoch=2, global_step=5)),
            False,
            keep_last=2,
        )
    assert (tmp_path / "checkpoint.pt").read_bytes() == before
    assert files.load(tmp_path / "checkpoint.pt")["epoch"] == 1
    # no temp file left
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "checkpoint-000000000.pt",
        "checkpoint.pt",
    ]


def test_garbage_and_unsafe_files_are_refused(tmp_path):
    torn = tmp_path / "torn.pt"
    torn.write_bytes(b"PK\x03\x04 not really")
    with pytest.raises(UserError, match="torn.pt"):
        files.load(torn)
    unsafe = tmp_path / "unsafe.pt"
    torch.save({"model": {}, "payload": Config()}, unsafe)  # an arbitrary object needs unpickling
    with pytest.raises(UserError, match="unsafe.pt"):
        files.load(unsafe)


def save_steps(out_dir, steps, keep_last=2, best_at=()):
    model, optimizer, scheduler = trained_model()
    for step in steps:
        state = TrainState(epoch=step // 10, global_step=step, epoch_step=step % 10)
        payload = gathered(model, optimizer, scheduler, state)
        files.save(out_dir, payload, step in best_at, keep_last)


def test_the_newest_keep_last_are_kept_and_checkpoint_pt_is_the_newest(tmp_path):
    save_steps(tmp_path, [4, 8, 12, 16], keep_last=3, best_at=(8,))
    assert [p.name for p in files.numbered(tmp_path)] == [
        "checkpoint-000000016.pt",
        "checkpoint-000000012.pt",
        "checkpoint-000000008.pt",
    ]
    assert (tmp_path / "checkpoint.pt").samefile(tmp_path / "checkpoint-000000016.pt")
    assert files.load(tmp_path / "model_best.pt")["global_step"] == 8
    assert not (tmp_path / "model_best.pt").samefile(tmp_path / "checkpoint-000000008.pt")


def test_going_back_to_an_earlier_checkpoint_makes_it_the_newest_again(tmp_path):
    save_steps(tmp_path, [4, 8, 12], keep_last=3)
    removed = roll_back(tmp_path, 4)
    assert [p.name for p in removed] == ["checkpoint-000000012.pt", "checkpoint-000000008.pt"]
    assert [p.name for p in files.numbered(tmp_path)] == ["checkpoint-000000004.pt"]
    assert (tmp_path / "checkpoint.pt").samefile(tmp_path / "checkpoint-000000004.pt")
    assert roll_back(tmp_path, 4) == []


def test_resolve(tmp_path):
    assert files.resolve(None, tmp_path) is None
    assert files.resolve("auto", tmp_path) is None
    save_steps(tmp_path, [3])
    assert files.resolve("auto", tmp_path) == tmp_path / "checkpoint-000000003.pt"
    with pytest.raises(UserError, match="nothere.pt"):
        files.resolve(str(tmp_path / "nothere.pt"), tmp_path)


def flip_a_byte(path, where):
    data = bytearray(path.read_bytes())
    data[int(len(data) * where)] ^= 0x10
    path.write_bytes(bytes(data))


def set_in_directory(path, offset, value):
    """A byte of the zip's first central-directory entry set to value."""
    data = bytearray(path.read_bytes())
    data[data.find(b"PK\x01\x02") + offset] = value
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "damage",
    [
        lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]),  # truncated
        lambda p: flip_a_byte(p, 0.5),  # in tensor data, where torch.load would not notice
        lambda p: p.write_bytes(b""),
        lambda p: set_in_directory(p, 8, 1),  # reads as encrypted: zipfile's RuntimeError
        lambda p: set_in_directory(p, 10, 1),  # another compression: NotImplementedError
    ],
    ids=["truncated", "flipped-byte", "empty", "encrypted-flag", "compression-method"],
)
def test_resume_auto_skips_a_damaged_newest_checkpoint_and_names_it(tmp_path, damage):
    save_steps(tmp_path, [4, 8])
    newest = tmp_path / "checkpoint-000000008.pt"
    (tmp_path / "checkpoint.pt").unlink()  # a link to newest: a second name for the same damage
    damage(newest)
    with pytest.raises(UserError, match="checkpoint-000000008.pt"):
        files.load(newest)
    skipped = []
    assert files.resolve("auto", tmp_path, skipped.append) == tmp_path / "checkpoint-000000004.pt"
    (warning,) = skipped
    assert warning.startswith("--resume auto skips a checkpoint: ")
    assert "checkpoint-000000008.pt" in warning


@pytest.mark.parametrize(
    "entry, value, named",
    [
        ("model", 5, "its 'model' is of type int"),
        ("config", "x", "its 'config' is of type str"),
        ("epoch", "abc", "its 'epoch' is of type str"),
        ("optimizer", [1, 2], "its 'optimizer' is of type list"),
        ("best_acc1", "x", "its 'best_acc1' is of type str"),
        ("global_step", True, "its 'global_step' is of type bool"),
        ("model", {"fc.weight": "not a tensor"}, "its weight 'fc.weight' is no tensor"),
    ],
)
def test_a_checkpoint_whose_entries_are_not_what_ddptrain_wrote_is_named(
    tmp_path, entry, value, named
):
    """Each loaded (plain data), then ended in a traceback inside whichever reader took it
    apart; --resume auto passes over it as over a damaged one."""
    save_steps(tmp_path, [4, 8])
    newest = tmp_path / "checkpoint-000000008.pt"
    torch.save({**torch.load(newest, weights_only=True), entry: value}, newest)
    with pytest.raises(
        UserError, match=f"checkpoint-000000008.pt is not a ddptrain checkpoint: {named}"
    ):
        files.load(newest)
    assert files.resolve("auto", tmp_path, lambda warning: None).name == "checkpoint-000000004.pt"


@pytest.mark.timeout(30)
def test_a_fifo_named_as_the_checkpoint_is_refused_not_waited_on(tmp_path):
    fifo = tmp_path / "checkpoint.pt"
    os.mkfifo(fifo)
    with pytest.raises(UserError, match="checkpoint.pt is not a checkpoint: not a regular file"):
        files.load(fifo)


def test_a_checkpoint_of_a_later_format_is_refused_not_skipped(tmp_path):
    save_steps(tmp_path, [4, 8])
    newest = tmp_path / "checkpoint-000000008.pt"
    later = {**torch.load(newest, weights_only=True), "format_version": FORMAT_VERSION + 1}
    torch.save(later, newest)
    message = (
        f"{newest} was written by a newer ddptrain (checkpoint format {FORMAT_VERSION + 1}; "
        f"this one reads formats 1 to {FORMAT_VERSION}): use that ddptrain or a later one"
    )
    with pytest.raises(files.NewerFormat) as refused:
        files.load(newest)
    assert str(refused.value) == message
    # Not skipped for the older one beside it, which would fork the run that wrote it.
    with pytest.raises(files.NewerFormat, match="checkpoint-000000008.pt"):
        files.resolve("auto", tmp_path)
    # Earlier formats (1: no format_version) still load.
    torch.save({k: v for k, v in later.items() if k != "format_version"}, newest)
    assert files.load(newest)["global_step"] == 8
    # A format that is no number is a damaged file: skipped, as any other.
    for nonsense in ("3", None, True, 0):
        torch.save({**later, "format_version": nonsense}, newest)
        with pytest.raises(UserError, match=r"is not a ddptrain checkpoint \(format_version"):
            files.load(newest)
        assert files.resolve("auto", tmp_path) == tmp_path / "checkpoint-000000004.pt"


def test_stale_temp_files_are_removed_and_never_chosen(tmp_path):
    save_steps(tmp_path, [4])
    stale = tmp_path / ".checkpoint-000000008.pt.abc123.tmp"
    stale.write_bytes(b"half a checkpoint")
    assert files.resolve("auto", tmp_path) == tmp_path / "checkpoint-000000004.pt"
    files.remove_stale_temp_files(tmp_path)
    assert not stale.exists()
    assert (tmp_path / "checkpoint-000000004.pt").exists()


class Crash(BaseException):
    """A save interrupted at a point (KeyboardInterrupt, say)."""


def killed_at(out_dir: Path, crash=Crash):
    """Raises `crash`, once out_dir is copied, as a process killed there (SIGKILL, which runs no
    cleanup) would have left it, to `<out_dir>-killed`."""
    shutil.copytree(out_dir, f"{out_dir}-killed", symlinks=True)
    raise crash


@pytest.mark.parametrize("point", ["before_rename", "after_rename"])
def test_a_best_copy_is_committed_with_its_checkpoint_or_not_at_all(tmp_path, monkeypatch, point):
    """Killed (or interrupted) between the checkpoint's rename and its best copy's: the next
    start promotes the copy (a checkpoint committed alone carried the raised best_acc1 on to
    every resume, which then never wrote model_best.pt again). Before the checkpoint's: both
    are gone."""
    out_dir = tmp_path / "run"
    out_dir.mkdir()
    save_steps(out_dir, [4], best_at=(4,))

    def crash_at(at, step):
        if at == point:
            killed_at(out_dir)

    with monkeypatch.context() as killed:
        killed.setattr(faults, "kill_point", crash_at)
        with pytest.raises(Crash):
            save_steps(out_dir, [8], best_at=(8,))
    step = 8 if point == "after_rename" else 4
    for left in (out_dir, tmp_path / "run-killed"):
        assert find_resume("auto", left, False, print).name == f"checkpoint-{step:09d}.pt"
        assert files.load(left / "model_best.pt")["global_step"] == step
        assert not [p.name for p in left.iterdir() if p.name.startswith(".")]


def test_only_ddptrains_own_temp_names_are_removed(tmp_path):
    """The out-dir may be the user's working directory (the default `.`): a glob on
    `.checkpoint*` removed their `.checkpoints/` folder with everything in it."""
    ours = [
        ".checkpoint-000000008.pt.k2j_x9aq.tmp",
        ".checkpoint.pt.k2j_x9aq.tmp",  # copied where the file system has no hard links
        ".model_best.pt.abc123.tmp",
        ".config.json.abc123.tmp",
        ".metrics.jsonl.abc123.tmp",
        ".summary.csv.abc123.tmp",
        ".profile.json.4242.tmp",
        ".checkpoint.pt.4242.link",
        ".checkpoint.dcp.4242.link",
        files.pending_best(tmp_path / files.BEST, 8).name,  # checkpoint-8 never committed
        f".{files.pending_best(tmp_path / files.BEST, 8).name}.abc123.tmp",
    ]
    folders = [
        sharded.temp_folder(tmp_path, 8).name,
        sharded.best_temp_folder(tmp_path).name,
        ".model_best.dcp.ema.tmp",  # an earlier ddptrain's name for it
        ".model_best.dcp.old",  # set aside, its replacement in place
        files.pending_best(tmp_path / sharded.BEST, 8).name,
    ]
    (tmp_path / "model_best.dcp").mkdir()
    users = [".checkpoint_notes", ".config.json.bak", ".model_best.pt.tmp", "x.tmp"]
    for name in ours + users:
        (tmp_path / name).write_text("x")
    (tmp_path / ".checkpoints" / "old").mkdir(parents=True)
    (tmp_path / ".checkpoints" / "old" / "weights.txt").write_text("keep")
    for name in folders:
        (tmp_path / name).mkdir()
        (tmp_path / name / "__0_0.distcp").write_text("x")
    files.remove_stale_temp_files(tmp_path)
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted([*users, ".checkpoints", "model_best.dcp"])
    assert (tmp_path / ".checkpoints" / "old" / "weights.txt").read_text() == "keep"


def test_incompatible_checkpoints_are_named(tmp_path):
    saved = {"arch": "resnet18", "class_to_idx": CLASSES}
    check_compatible(saved, tmp_path, "resnet18", CLASSES)
    with pytest.raises(UserError, match="resnet18 model, not --arch resnet34"):
        check_compatible(saved, tmp_path, "resnet34", CLASSES)
    with pytest.raises(UserError, match=r"only in the checkpoint: 'c'; only in the data: 'd'\)"):
        check_compatible(saved, tmp_path, "resnet18", {"a": 0, "b": 1, "d": 2})
    imagenet = {f"n{i:08d}": i for i in range(1000)}  # named in one short line
    with pytest.raises(UserError, match=r"'n00000004', and 995 more; only in the data: 'a', 'b'"):
        check_compatible({**saved, "class_to_idx": imagenet}, tmp_path, "resnet18", CLASSES)


def test_the_gradient_scaler_is_saved_and_restored(tmp_path):
    """fp16 runs on CUDA only; the CPU GradScaler has the same state dict and code path."""
    model, optimizer, scheduler = trained_model()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1)
    loss = model(torch.randn(2, 3, 32, 32)).logsumexp(1).mean()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()  # a finite step with growth_interval 1: the scale doubles
    state = TrainState(global_step=1)
    payload = gathered(model, optimizer, scheduler, state, scaler)
    files.save(tmp_path, payload, False, keep_last=2)

    fresh = torchvision.models.get_model("resnet18", num_classes=3)
    fresh_opt, fresh_sched = build_optimizer(fresh, Config(lr=0.1).optim)
    fresh_scaler = torch.amp.GradScaler("cpu", init_scale=1.0, growth_interval=1)
    saved = files.load(tmp_path / "checkpoint.pt")
    checkpointer(tmp_path, fresh, fresh_opt, fresh_sched, fresh_scaler).restore(saved)
    assert scaler.get_scale() == 2048.0
    assert fresh_scaler.state_dict() == scaler.state_dict()


def test_a_checkpoint_that_does_not_fit_the_model_is_named_before_loading(tmp_path):
    model, optimizer, scheduler = trained_model()
    saved = gathered(model, optimizer, scheduler, TrainState())
    check_fits(saved, tmp_path, torchvision.models.get_model("resnet18", num_classes=3))
    other_head = torchvision.models.get_model("resnet18", num_classes=5)
    with pytest.raises(UserError, match=r"fc.weight is \(3, 512\) in the checkpoint, \(5, 512\)"):
        check_fits(saved, tmp_path, other_head)
    shorter = torchvision.models.get_model("resnet18", num_classes=3)
    del shorter.layer4
    with pytest.raises(UserError, match="unexpected layer4"):
        check_fits(saved, tmp_path, shorter)


def test_another_optimizer_or_schedule_kind_on_resume_is_one_line(tmp_path):
    """Their saved states load only into their own kinds: --opt adamw on an sgd checkpoint
    ended in a KeyError inside the load, a warmup added in another; a schedule's shape given
    anew was undone by the load."""
    saved = {"config": Config(lr_scheduler="cosine", epochs=2).to_dict()}
    same = Config(lr_scheduler="cosine", epochs=2, lr=0.5, lr_step_size=9)  # not cosine's shape
    check_continuable(saved, same, tmp_path)
    step = {"config": Config(epochs=2, lr_milestones=(1,)).to_dict()}
    check_continuable(step, Config(epochs=90), tmp_path)  # a step schedule has no length
    check_continuable(step, Config(opt="sgd-nesterov"), tmp_path)  # sgd's state, its nesterov
    for changed, flag in [
        (dict(opt="adamw"), "--opt adamw (trained with sgd)"),
        (dict(lr_scheduler="step"), "--lr-scheduler step (trained with cosine)"),
        (dict(lr_warmup_epochs=1), "--lr-warmup-epochs 1 (trained with 0)"),
        # Undone by the load: a cosine stretched to 4 epochs rose again after its second.
        (dict(epochs=4), "--epochs 4 (trained with 2)"),
        (dict(lr_min=0.001), "--lr-min 0.001 (trained with 0)"),
    ]:
        config = Config(**{"lr_scheduler": "cosine", "epochs": 2, **changed})
        with pytest.raises(UserError, match=re.escape(flag) + ".*--pretrained"):
            check_continuable(saved, config, tmp_path)
    with pytest.raises(UserError, match=re.escape("--lr-milestones 1 2 (trained with 1)")):
        check_continuable(step, Config(lr_scheduler="multistep", lr_milestones=(1, 2)), tmp_path)
    # Counted in optimizer steps of the batch they were made for: a step schedule's drop came an
    # epoch late under -b 32 after -b 16.
    with pytest.raises(UserError, match=re.escape("--batch-size 32 (trained with 256)")):
        check_continuable(step, Config(batch_size=32), tmp_path)
    plain = {"config": Config(lr_scheduler="none").to_dict()}
    check_continuable(plain, Config(lr_scheduler="none", batch_size=32), tmp_path)  # no steps
    ema = Config(lr_scheduler="none", batch_size=32, model_ema=True)
    check_continuable(plain, ema, tmp_path)  # its decay is per optimizer step, at any batch
    # Norms given their own weight decay: two parameter groups where one was saved, which
    # loaded without a word and left the other weights at the first LR.
    with pytest.raises(UserError, match=re.escape("--norm-weight-decay 0 (trained without it)")):
        check_continuable(step, Config(norm_weight_decay=0.0), tmp_path)
    norms = {"config": Config(norm_weight_decay=0.0).to_dict()}
    check_continuable(norms, Config(norm_weight_decay=1e-5), tmp_path)  # the same groups
    with pytest.raises(UserError, match=re.escape("no --norm-weight-decay (trained with 0)")):
        check_continuable(norms, Config(), tmp_path)


def test_a_resume_asks_for_the_flags_that_left_images_out(tmp_path):
    """The images --bad-images skip leaves out are found before the checkpoint is read:
    resumed without the --max-image-pixels that left one out, the run was refused as trained
    on other data ("trained on 8 train images, and DATA has 9 now")."""
    skipped = Config(bad_images="skip", max_image_pixels=500).to_dict()
    for argv, flag in [
        ([], "--bad-images skip"),
        (["--bad-images", "skip"], "--max-image-pixels 500"),
    ]:
        _, (given, layers) = cli.parse(["train", str(tmp_path), *argv])
        with pytest.raises(UserError, match=f"trained with {flag}: give it again"):
            check_same_leave_out(given, resumed(given, layers, skipped), tmp_path)
    argv = ["--bad-images", "skip", "--max-image-pixels", "500"]
    _, (given, layers) = cli.parse(["train", str(tmp_path), *argv])
    check_same_leave_out(given, resumed(given, layers, skipped), tmp_path)
    # Nothing left out: the loaders take the checkpoint's settings, and nothing is asked.
    checked = Config(verify_images=True, max_image_pixels=500).to_dict()
    _, (given, layers) = cli.parse(["train", str(tmp_path)])
    check_same_leave_out(given, resumed(given, layers, checked), tmp_path)
    _, (given, layers) = cli.parse(["train"])  # the built-in data set is not checked
    check_same_leave_out(given, resumed(given, layers, skipped), tmp_path)


def test_a_config_json_that_is_not_ddptrains_is_refused_not_overwritten(tmp_path):
    """The default --out-dir is `.`: a project's own config.json was replaced at the first save."""
    theirs = tmp_path / "config.json"
    for text in ('{"model": "unet", "lr": 3}', "not json", "[1, 2]"):
        theirs.write_text(text)
        with pytest.raises(UserError, match="config.json there is not ddptrain's"):
            check_out_dir(tmp_path, None, evaluate=False, auto=False)
        assert theirs.read_text() == text
    theirs.write_text(json.dumps({**Config().to_dict(), "resolved": {"world_size": 1}}))
    check_out_dir(tmp_path, None, evaluate=False, auto=True)  # a run's own: resumed


@pytest.mark.parametrize("best", ["model_best.pt", "model_best.dcp"])
def test_an_out_dir_holding_an_earlier_runs_best_alone_is_not_started_over(tmp_path, best):
    """Its checkpoints deleted to free room, the best model kept: a fresh run there would
    overwrite it with its own (and drop the earlier run's records)."""
    kept = tmp_path / best
    kept.mkdir() if best.endswith(".dcp") else kept.write_bytes(b"weights")
    message = f"holds {best} of an earlier run and no checkpoint: this run would overwrite it"
    for auto in (False, True):
        with pytest.raises(UserError, match=message):
            check_out_dir(tmp_path, None, evaluate=False, auto=auto)
    check_out_dir(tmp_path, kept, evaluate=False, auto=False)  # --resume model_best.pt: its own
    check_out_dir(tmp_path, None, evaluate=True, auto=False)  # eval writes no checkpoint
