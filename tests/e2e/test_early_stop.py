"""--early-stop PATIENCE: every rank stops after the same epoch, and a resumed run continues the
count of epochs without a better val top-1 instead of starting it again."""

import json

from cli import ddptrain, ok, tiny_args, torchrun, training_state

# At --lr 0 a model without BatchNorm never changes (no running statistics either), so its val
# top-1 is the same every epoch and at any world size: epoch 1 sets the best, the next PATIENCE
# epochs bring nothing better, and training stops after epoch PATIENCE + 1.
PATIENCE = 2


def args(data, out, epochs):
    flags = ("-a", "squeezenet1_1", "--image-size", 32, "--lr", 0, "--early-stop", PATIENCE)
    return ("train", *tiny_args(data, out, *flags, "--epochs", epochs), "--resume", "auto")


def records(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def stopped_after(out) -> int:
    (stop,) = [r for r in records(out) if r["split"] == "early_stop"]
    assert stop["patience"] == PATIENCE and stop["stale_epochs"] == PATIENCE
    return stop["epoch"]


def test_one_and_two_ranks_stop_after_the_same_epoch_and_a_resume_continues_the_count(
    tiny_data, tmp_path
):
    one, two = tmp_path / "one", tmp_path / "two"
    result = ok(ddptrain(*args(tiny_data, one, 6)))
    first_val = next(r for r in records(one) if r["split"] == "val")
    assert first_val["acc1"] > 0  # else epoch 1 would not be a best, and the count starts there
    assert stopped_after(one) == PATIENCE + 1
    assert f"training stops after epoch {PATIENCE + 1}" in result.stdout
    assert max(r["epoch"] for r in records(one)) == PATIENCE + 1

    # Two ranks, stopped after epoch 2 by --epochs (one epoch without a better top-1), then
    # resumed for 6: one more epoch without, not two.
    ok(torchrun(2, *args(tiny_data, two, PATIENCE)))
    assert training_state(two)["stale_epochs"] == PATIENCE - 1
    ok(torchrun(2, *args(tiny_data, two, 6)))
    assert stopped_after(two) == PATIENCE + 1
    assert training_state(two)["epoch"] == PATIENCE + 1
