"""A disk that fills while a checkpoint is written: one error line, exit 2, the previous
checkpoint intact and chosen by --resume auto, and (under torchrun) every rank ends.

The tiny run: 24 images, global batch 8, 3 steps an epoch; checkpoints at global steps 3 and 6.
The full disk is injected with DDPTRAIN_TEST_ENOSPC (see ddptrain/faults.py).
"""

from cli import assert_same_training, ddptrain, ok, tiny_args, torchrun, training_state

FULL_AT_STEP_6 = {"DDPTRAIN_TEST_ENOSPC": "checkpoint-000000006.pt"}
# Shorter than --dist-timeout: ranks left waiting for rank 0 would fail the test, not wait.
NO_HANG = 120


def args(data, out, *extra):
    return ("train", *tiny_args(data, out), "--epochs", 2, "--resume", "auto", *extra)


def test_a_full_disk_ends_the_run_in_one_line_and_resume_continues_bitwise(tiny_data, tmp_path):
    straight, out = tmp_path / "straight", tmp_path / "run"
    ok(ddptrain(*args(tiny_data, straight)))

    failed = ddptrain(*args(tiny_data, out), env=FULL_AT_STEP_6)
    assert failed.returncode == 2, failed.stderr
    errors = [line for line in failed.stderr.splitlines() if line.startswith("ddptrain: error:")]
    assert len(errors) == 1 and "Traceback" not in failed.stderr, failed.stderr
    assert f"cannot write {out}/checkpoint-000000006.pt: No space left on device" in errors[0]
    assert "it needs " in errors[0] and " free" in errors[0]
    assert training_state(out)["global_step"] == 3
    assert not [p.name for p in out.iterdir() if p.name.startswith(".checkpoint")]

    resumed = ok(ddptrain(*args(tiny_data, out)))
    assert f"resumed from {out}/checkpoint-000000003.pt" in resumed.stdout
    assert_same_training(straight, out)


def test_a_full_disk_on_rank_0_ends_every_rank_under_torchrun(tiny_data, tmp_path):
    out = tmp_path / "run"
    full_at_step_3 = {"DDPTRAIN_TEST_ENOSPC": "checkpoint-000000003.pt"}
    result = torchrun(
        2, *args(tiny_data, out, "--dist-timeout", 600), env=full_at_step_3, timeout=NO_HANG
    )
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("ddptrain: error:")]
    assert any(f"cannot write {out}/checkpoint-000000003.pt: No space" in e for e in errors)
    # Rank 1 learns of it at once: every rank agrees on the outcome of a checkpoint's write.
    assert any("another rank failed while writing a checkpoint" in e for e in errors), errors
    assert not any(p.name.startswith(".checkpoint") for p in out.iterdir())


def test_a_full_disk_while_recording_an_epoch_ends_every_rank_at_once(tiny_data, tmp_path):
    out = tmp_path / "run"
    full = {"DDPTRAIN_TEST_ENOSPC": "metrics.jsonl"}
    result = torchrun(2, *args(tiny_data, out, "--dist-timeout", 600), env=full, timeout=NO_HANG)
    errors = [line for line in result.stderr.splitlines() if line.startswith("ddptrain: error:")]
    assert any(f"cannot write {out}/metrics.jsonl: No space" in e for e in errors), errors
    assert any("another rank failed while writing metrics.jsonl" in e for e in errors), errors
    assert not (out / "checkpoint.pt").exists()  # the epoch's checkpoint comes after its records
