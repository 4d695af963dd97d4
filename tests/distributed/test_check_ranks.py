"""Bad images over ranks: each rank checks its share, all end with the same list, or all stop."""

import shutil

import torch
from harness import run_ranks

from ddptrain.config import Config
from ddptrain.data.check import images_to_leave_out
from ddptrain.distributed.env import DistEnv

ONE = DistEnv(0, 1, 0, 1, torch.device("cpu"))


def _leave_out(env, data, bad_images):
    config = Config(data=str(data), workers=0, bad_images=bad_images, verify_images=True)
    try:
        return sorted(images_to_leave_out(config, env))
    except ValueError as err:  # UserError
        return f"error: {err}"


def test_every_rank_leaves_out_the_same_files_whichever_rank_found_them(tiny_data, tmp_path):
    data = shutil.copytree(tiny_data, tmp_path / "data")
    # The 1st and the 4th of the sorted list: one in each rank's share of 2 ranks, 3 ranks...
    for name in ("arrow/00000.png", "arrow/00003.png"):
        (data / "train" / name).write_bytes(b"garbage")
    expected = ["train/arrow/00000.png", "train/arrow/00003.png"]
    assert _leave_out(ONE, data, "skip") == expected
    assert run_ranks(_leave_out, 3, data, "skip", timeout=120) == [expected] * 3


def test_a_bad_image_in_one_ranks_share_stops_every_rank(tiny_data, tmp_path):
    data = shutil.copytree(tiny_data, tmp_path / "data")
    (data / "val" / "bar" / "00001.png").write_bytes(b"garbage")
    results = run_ranks(_leave_out, 2, data, "error", timeout=120)
    assert all(r.startswith("error: --verify-images: 1 of 39 images in ") for r in results), results
