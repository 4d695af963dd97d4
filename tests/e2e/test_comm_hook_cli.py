"""--ddp-comm-hook through the CLI: powersgd's state is in the checkpoint and a resume takes it."""

from cli import ok, tiny_args, torchrun
from cli import training_state as state

POWERSGD = ("--ddp-comm-hook", "powersgd", "--powersgd-start-step", "2", "--powersgd-rank", "2")


def test_powersgd_state_is_checkpointed_and_resumed(tiny_data, tmp_path):
    ok(torchrun(2, "train", *tiny_args(tiny_data, tmp_path), *POWERSGD))
    saved = state(tmp_path)["powersgd"]
    assert saved["iter"] == state(tmp_path)["global_step"] == 3
    assert len(saved["errors_by_rank"]) == 2 and saved["q_memory"]
    args = (*tiny_args(tiny_data, tmp_path), "--epochs", "2", "--resume", "auto")
    ok(torchrun(2, "train", *args))  # the checkpoint's settings bring the hook back
    assert state(tmp_path)["powersgd"]["iter"] == state(tmp_path)["global_step"] == 6
    assert state(tmp_path)["config"]["ddp_comm_hook"] == "powersgd"
