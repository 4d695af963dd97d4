"""Resume on changed data: one line saying what changed, never a position past the epoch's end.

The tiny run: 24 train images, global batch 8, 3 steps an epoch. A SIGUSR1 before step 3 stops
the run after step 2, mid-epoch; then the data shrinks to 9 images, one step an epoch.
"""

import shutil

import torch
from cli import ddptrain, tiny_args, training_state


def stopped_mid_epoch(data, out):
    stop = {"DDPTRAIN_TEST_KILL": "between:0:3", "DDPTRAIN_TEST_SIGNAL": "SIGUSR1"}
    stopped = ddptrain("train", *tiny_args(data, out), "--resume", "auto", env=stop)
    assert stopped.returncode == 0, stopped.stderr
    assert "ddptrain: stopped by SIGUSR1 after global step 2" in stopped.stderr
    assert training_state(out)["epoch_step"] == 2


def shrink(data, keep_per_class=3):
    for folder in (data / "train").iterdir():
        for image in sorted(folder.iterdir())[keep_per_class:]:
            image.unlink()


def one_error_line(result) -> str:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    errors = [e for e in result.stderr.splitlines() if e.startswith("ddptrain: error:")]
    assert len(errors) == 1, result.stderr
    return errors[0]


def test_resume_on_a_shrunk_data_set_says_what_changed(tiny_data, tmp_path):
    data, out = shutil.copytree(tiny_data, tmp_path / "data"), tmp_path / "run"
    stopped_mid_epoch(data, out)
    shrink(data)
    error = one_error_line(ddptrain("train", *tiny_args(data, out), "--resume", "auto"))
    assert "was trained on 24 train images, and DATA has 9 now" in error


def test_an_older_checkpoint_on_a_shrunk_data_set_is_refused_not_asserted(tiny_data, tmp_path):
    data, out = shutil.copytree(tiny_data, tmp_path / "data"), tmp_path / "run"
    stopped_mid_epoch(data, out)
    # As written before checkpoints recorded their data.
    checkpoint = out / "checkpoint.pt"
    older = torch.load(checkpoint, weights_only=True)
    del older["data_facts"]
    checkpoint.unlink()  # a hard link to the numbered file: replace both names' contents
    torch.save(older, out / "checkpoint-000000002.pt")
    shrink(data)
    error = one_error_line(ddptrain("train", *tiny_args(data, out), "--resume", "auto"))
    assert (
        "stopped at step 2 of an epoch, and an epoch of DATA's 9 train images has only 1 step"
        in error
    )
