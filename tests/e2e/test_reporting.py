"""What a run shows and records, through the real CLI: a bar on a terminal, lines in a pipe, the
start-up summary, and summary.csv and TensorBoard continued without duplicates after a restart.
"""

import csv
import fcntl
import json
import os
import pty
import shutil
import struct
import subprocess
import sys
import termios

from cli import DEADLINE, ddptrain, env_with, ok, tiny_args, torchrun


def test_a_terminal_gets_a_bar_and_a_pipe_gets_lines(tiny_data, tmp_path):
    args = ["train", *map(str, tiny_args(tiny_data, tmp_path / "tty")), "--epochs", "2"]
    primary, secondary = pty.openpty()
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))  # rows, cols
    proc = subprocess.Popen(
        [sys.executable, "-m", "ddptrain", *args],
        stdout=secondary,
        stderr=subprocess.DEVNULL,
        env=env_with(),
    )
    os.close(secondary)
    screen = b""
    while True:
        try:
            chunk = os.read(primary, 4096)
        except OSError:  # the other end closed
            break
        if not chunk:
            break
        screen += chunk
    assert proc.wait(timeout=DEADLINE) == 0
    text = screen.decode(errors="replace")
    assert "epoch 1/2: 100%" in text and "step" in text and "run left" in text
    assert "\r" in text  # the bar redraws in place
    assert "epoch 2/2 done" in text

    piped = ok(
        subprocess.run(
            [sys.executable, "-m", "ddptrain", *args[:-2], "--out-dir", str(tmp_path / "pipe")],
            capture_output=True,
            text=True,
            timeout=DEADLINE,
            env=env_with(),
        )
    )
    assert "epoch 1/1 [1/3] loss" in piped.stdout and "%|" not in piped.stdout
    for name in ("world", "batch", "steps/epoch", "model", "strategy", "data", "start"):
        assert f"{name}: " in piped.stdout, name


def rows(out_dir) -> list[dict]:
    with open(out_dir / "summary.csv", newline="") as f:
        return list(csv.DictReader(f))


def scalar_steps(out_dir, tag: str) -> list[int]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out_dir / "tensorboard"))
    events.Reload()
    return [event.step for event in events.Scalars(tag)]


def per_class_records(out_dir) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "per_class.jsonl").read_text().splitlines()]


def per_class_epochs(out_dir) -> list[tuple[str, int]]:
    return [(r["split"], r["epoch"]) for r in per_class_records(out_dir)]


def test_records_continue_once_each_after_a_restart(tiny_data, tmp_path):
    # Killed while committing epoch 1's checkpoint (global step 3), after its records were
    # written: the restart resumes from step 2, drops them, and records them again.
    out, marker = tmp_path / "run", tmp_path / "killed"
    args = ("train", *tiny_args(tiny_data, out), "--checkpoint-every", 2)
    args = (*args, "--resume", "auto", "--tensorboard", "--epochs", 2)
    kill = {"DDPTRAIN_TEST_KILL": "before_rename:0:3", "DDPTRAIN_TEST_KILL_ONCE": str(marker)}
    ok(torchrun(2, *args, env=kill, restarts=2))
    assert marker.exists(), "the fault never fired"
    assert [r["epoch"] for r in rows(out)] == ["1", "2"]
    assert {"train_loss", "val_acc1", "lr"} <= rows(out)[0].keys()
    assert scalar_steps(out, "val/acc1") == [3, 6]
    assert scalar_steps(out, "step/loss") == [1, 2, 3, 4, 5, 6]  # -p 1: every step once
    assert per_class_epochs(out) == [("val", 1), ("val", 2)]

    ok(torchrun(2, *args[:-1], 3))  # one more epoch
    assert [r["epoch"] for r in rows(out)] == ["1", "2", "3"]
    assert per_class_epochs(out) == [("val", 1), ("val", 2), ("val", 3)]
    assert scalar_steps(out, "val/acc1") == [3, 6, 9]


def test_profile_writes_rank_0s_trace_of_the_steps_asked_for(tiny_data, tmp_path):
    result = ok(torchrun(2, "train", *tiny_args(tiny_data, tmp_path), "--profile", 2))
    assert f"--profile 2: trace in {tmp_path / 'profile.json'}" in result.stdout
    events = json.loads((tmp_path / "profile.json").read_text())["traceEvents"]
    steps = {e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")}
    assert len(steps) == 2  # the warm-up step is not recorded
    assert not list(tmp_path.glob(".profile.json.*"))


def test_eval_into_a_run_dir_appends_its_val_record_and_changes_nothing_else(
    tiny_data, tmp_path, one_rank_run
):
    run = tmp_path / "run"
    shutil.copytree(one_rank_run, run)
    before = (run / "summary.csv").read_text()
    records = (run / "metrics.jsonl").read_text().splitlines()
    args = ("eval", *tiny_args(tiny_data, run), "--resume", run / "checkpoint.pt")
    ok(ddptrain(*args, "--tensorboard"))
    assert (run / "summary.csv").read_text() == before  # the training's own row
    assert not (run / "tensorboard").exists()
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert lines[:-1] == records
    trained, evaluated = json.loads(records[-1]), json.loads(lines[-1])
    assert evaluated["split"] == "val" and evaluated["samples"] == 15
    assert (evaluated["epoch"], evaluated["global_step"]) == (1, trained["global_step"])
    # and per_class.jsonl its per-class record, whose diagonal is acc1's hits
    assert per_class_epochs(run) == [("val", 1), ("val", 1)]
    classes = per_class_records(run)[-1]
    assert classes["classes"] == sorted(folder.name for folder in (tiny_data / "val").iterdir())
    assert [sum(row) for row in classes["confusion"]] == [5, 5, 5]
    hits = sum(classes["confusion"][i][i] for i in range(3))
    assert 100 * hits / 15 == evaluated["acc1"]
