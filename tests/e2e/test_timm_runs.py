"""timm's models through the real CLI: a ViT built for 32 px crops under fsdp on 2 ranks (exact
evaluation, its EMA, a killed rank restarted bitwise), and --pretrained from a Hugging Face cache
the test writes, or from none with no network. (Export into timm: tests/unit/test_timm_models.py;
fsdp against ddp: tests/distributed/test_fsdp.py.)

The network is cut with `unshare -rn` (a user and network namespace holding only loopback)
where the kernel allows it, else the Hub's client is told it is offline (HF_HUB_OFFLINE=1).
"""

import os
import shutil
import subprocess
import sys
import time

import pytest
import timm
import torch
from cli import assert_same_training, ok, tiny_args, torchrun, training_state, val_records
from safetensors.torch import save_file
from test_user_errors import assert_user_error

VIT = ("-a", "timm:test_vit", "--image-size", "32")
REVISION = "0" * 40


def args(data, out, *extra):
    return (
        *("train", *tiny_args(data, out, *VIT), "--resume", "auto", "--strategy", "fsdp"),
        *("--epochs", 2, "--checkpoint-every", 2, "--model-ema", *extra),
    )


@pytest.fixture(scope="module")
def uninterrupted(tiny_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("timm-fsdp")
    result = ok(torchrun(2, *args(tiny_data, out)))
    assert "model: timm:test_vit" in result.stdout and "strategy: fsdp" in result.stdout
    assert "plan: fsdp, 4 per rank: peak " in result.stdout  # traced, not "not available"
    assert training_state(out)["global_step"] == 6
    return out


def test_a_timm_model_evaluates_exactly_on_two_fsdp_ranks(uninterrupted):
    for split in ("val", "val_ema"):
        records = val_records(uninterrupted, split)
        assert [r["samples"] for r in records] == [15, 15], split  # 7 and 8 a rank
    # the checkpoint holds timm's own names (exported and loaded into timm: tests/unit)
    saved = training_state(uninterrupted)["model"]
    assert saved.keys() == timm.create_model("test_vit", num_classes=3).state_dict().keys()


def test_a_killed_rank_of_a_timm_run_restarts_and_ends_bitwise_equal(
    tiny_data, tmp_path, uninterrupted
):
    out, marker = tmp_path / "run", tmp_path / "killed"
    env = {"DDPTRAIN_TEST_KILL": "data:1:5", "DDPTRAIN_TEST_KILL_ONCE": str(marker)}
    result = ok(torchrun(2, *args(tiny_data, out), env=env, restarts=2))
    assert marker.exists(), "the fault never fired"
    assert f"resumed from {out}/checkpoint-{4:09d}.pt" in result.stdout
    assert_same_training(uninterrupted, out)


def without_network(command: list[str]) -> list[str]:
    return ["unshare", "-rn", *command] if _can_unshare() else command


def _can_unshare() -> bool:
    if shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "-rn", "true"], capture_output=True).returncode == 0


def offline(hf_home) -> dict:
    env = {"HF_HOME": str(hf_home)}
    return env if _can_unshare() else {**env, "HF_HUB_OFFLINE": "1"}


def cache_entry(hf_home, published: dict) -> None:
    """The Hub cache's layout, as `hf download timm/test_vit.r160_in1k` leaves it."""
    repo = hf_home / "hub" / "models--timm--test_vit.r160_in1k"
    (repo / "snapshots" / REVISION).mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    save_file(published, repo / "snapshots" / REVISION / "model.safetensors")


def train_offline(data, out, hf_home, *extra, timeout=240):
    command = [sys.executable, "-m", "ddptrain", "train", *tiny_args(data, out, *VIT, *extra)]
    return subprocess.run(
        without_network(command),
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "OMP_NUM_THREADS": "1", **offline(hf_home)},
    )


def test_pretrained_takes_timms_weights_from_the_hugging_face_cache(tiny_data, tmp_path):
    torch.manual_seed(3)
    published = timm.create_model("test_vit").state_dict()  # 1000 classes, 160 px
    cache_entry(tmp_path / "hf", published)
    # A learning rate too small to move them: the weights the run saves are the ones it loaded.
    result = ok(
        train_offline(
            tiny_data, tmp_path / "out", tmp_path / "hf", "--pretrained", "--interpolation",
            "bilinear", "--lr", "1e-12", "--wd", "0", "--momentum", "0",
        )
    )  # fmt: skip
    assert "pretrained timm:test_vit: new weights for head.bias, head.weight" in result.stdout
    # the weights' own mean, std and crop fraction (0.95); the flags' size and interpolation
    assert (
        "input: 32 px train crops, val resize 33 crop 32, bilinear, mean (0.5, 0.5, 0.5), "
        "std (0.5, 0.5, 0.5)"
    ) in result.stdout
    saved = training_state(tmp_path / "out")
    assert saved["config"]["mean"] == (0.5, 0.5, 0.5) and saved["config"]["val_resize"] == 33
    # every weight but the head and the 160 px position embedding (resampled to 2x2 patches)
    for name, tensor in saved["model"].items():
        if name not in ("head.weight", "head.bias", "pos_embed"):
            torch.testing.assert_close(tensor, published[name], rtol=0, atol=1e-6, msg=name)
    assert saved["model"]["pos_embed"].shape == (1, 5, 64)


def test_pretrained_with_nothing_cached_and_no_network_is_one_line_at_once(tiny_data, tmp_path):
    start = time.monotonic()
    result = train_offline(tiny_data, tmp_path / "out", tmp_path / "hf", "--pretrained")
    # the start-up and the refusal, never the Hub client's half minute of retries
    assert time.monotonic() - start < 60
    assert_user_error(
        result,
        "--pretrained: the weights timm/test_vit.r160_in1k (model.safetensors) are not in the "
        "Hugging Face cache",
        "hf download timm/test_vit.r160_in1k model.safetensors",
    )
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
