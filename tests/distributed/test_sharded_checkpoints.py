"""--checkpoint-format sharded on real gloo ranks: each rank writes its shards into one DCP
folder, which resumes on other world sizes and strategies and converts to the single file."""

import pytest
import torch
from harness import run_ranks
from test_fsdp import train_epoch

from ddptrain.state.files import load, numbered
from ddptrain.state.sharded import to_single


@pytest.fixture(scope="module")
def sharded_epoch(tiny_data, tmp_path_factory):
    """Epoch 1 on 2 fsdp ranks, saved sharded: (out_dir, the weights rank 0 gathered)."""
    out_dir = tmp_path_factory.mktemp("sharded")
    weights = run_ranks(train_epoch, 2, tiny_data, out_dir, "fsdp", None, True)[0]
    return out_dir, weights


def flat(state: dict) -> torch.Tensor:
    return torch.cat([v.flatten() for v in state.values()])


def test_each_rank_writes_its_shards_into_one_folder(sharded_epoch):
    out_dir, weights = sharded_epoch
    [folder] = numbered(out_dir)
    assert folder.name == "checkpoint-000000002.dcp" and folder.is_dir()
    assert sorted(p.name for p in folder.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert (out_dir / "checkpoint.dcp").resolve() == folder.resolve()
    assert not list(out_dir.glob(".checkpoint-*"))  # the temp folder was renamed into place
    converted = to_single(folder)
    torch.testing.assert_close(flat(converted["model"]), weights, rtol=0, atol=0)
    assert converted["global_step"] == 2 and converted["optimizer"]["state"]


def test_a_sharded_checkpoint_resumes_on_other_world_sizes(tiny_data, tmp_path, sharded_epoch):
    """Epoch 2 from the folder, on 1 rank (ddp) and 3 (fsdp), ends where 2 fsdp ranks do from
    the same folder (optimizer state included, or they would differ)."""
    folder = numbered(sharded_epoch[0])[0]
    reference = run_ranks(train_epoch, 2, tiny_data, tmp_path / "2", "fsdp", folder, True)[0]
    for world, strategy in ((1, "ddp"), (3, "fsdp")):
        out_dir = tmp_path / str(world)
        weights = run_ranks(train_epoch, world, tiny_data, out_dir, strategy, folder, True)[0]
        torch.testing.assert_close(weights, reference, rtol=0, atol=1e-5, msg=f"{world} ranks")
        saved = flat(to_single(numbered(out_dir)[0])["model"])
        torch.testing.assert_close(saved, weights, rtol=0, atol=0)


def test_the_converted_file_resumes_like_the_folder(tiny_data, tmp_path, sharded_epoch):
    folder = numbered(sharded_epoch[0])[0]
    single = tmp_path / "converted.pt"
    torch.save(to_single(folder), single)
    assert load(single)["arch"] == "resnet18"
    from_file = run_ranks(train_epoch, 2, tiny_data, tmp_path / "f", "fsdp", single)[0]
    from_folder = run_ranks(train_epoch, 2, tiny_data, tmp_path / "d", "fsdp", folder, True)[0]
    torch.testing.assert_close(from_file, from_folder, rtol=0, atol=1e-6)
