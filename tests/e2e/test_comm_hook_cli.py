"""--ddp-comm-hook through the CLI: powersgd's state is in the checkpoint and a resume takes it."""

import torch
from cli import assert_same_training, assert_same_weights, ok, tiny_args, torchrun
from cli import training_state as state

POWERSGD = ("--ddp-comm-hook", "powersgd", "--powersgd-start-step", "2", "--powersgd-rank", "2")


def test_powersgd_state_is_checkpointed_and_resumed_bitwise(tiny_data, tmp_path):
    """A resnet18 on 2 ranks, 3 steps an epoch: resumed at the epoch's end (step 3) and in the
    middle of the next (step 4), it ends bitwise where the uninterrupted run does. Before the
    state followed DDP's bucket layout, these runs ended 255 and 143 apart (max weight)."""
    whole = tmp_path / "whole"  # checkpoints at steps 2, 3 (the epoch's end), 4 and 6
    keep = ("--checkpoint-every", "2", "--keep-last", "4")
    ok(torchrun(2, "train", *tiny_args(tiny_data, whole), *POWERSGD, "--epochs", "2", *keep))

    at_epoch_end = torch.load(whole / "checkpoint-000000003.pt", weights_only=True)
    saved = at_epoch_end["powersgd"]
    assert saved["iter"] == at_epoch_end["global_step"] == 3
    assert len(saved["errors_by_rank"]) == 2 and saved["q_memory"] and saved["layouts"]
    for step in (3, 4):  # no hook flags: the checkpoint's settings bring the hook back
        out = tmp_path / f"from-{step}"
        resume = ("--epochs", "2", "--resume", whole / f"checkpoint-{step:09d}.pt")
        ok(torchrun(2, "train", *tiny_args(tiny_data, out), *resume))
        assert state(out)["powersgd"]["iter"] == state(out)["global_step"] == 6
        assert state(out)["config"]["ddp_comm_hook"] == "powersgd"
        assert_same_weights(state(whole)["model"], state(out)["model"])
    assert_same_training(whole, tmp_path / "from-3", epochs_in_b=1)
