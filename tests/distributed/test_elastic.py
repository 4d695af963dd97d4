"""A checkpoint taken mid-epoch on W ranks continues on W' ranks: the same global sample order
from the same position, so a BatchNorm-free model ends where an uninterrupted run ends."""

import json

import pytest
import torch
from harness import run_ranks
from test_ddp import bn_free_model, flat_params

from ddptrain.config import Config
from ddptrain.data.loaders import build_data
from ddptrain.data.sources import open_source
from ddptrain.model.precision import Precision
from ddptrain.parallel.parallelize import unwrap, wrap
from ddptrain.report.reporter import Reporter
from ddptrain.state.checkpointer import Checkpointer, TrainState, training_parts
from ddptrain.state.files import load
from ddptrain.train import trainer
from ddptrain.train.optim import build_optimizer
from ddptrain.train.preempt import StopRequests


def fit(env, root, out_dir, resume=None):
    """Two epochs of 3 steps, a checkpoint every 2 steps (global steps 2 and 4)."""
    out_dir.mkdir(exist_ok=True)
    config = Config(
        data=str(root), batch_size=8, workers=0, image_size=16, epochs=2, print_freq=100,
        checkpoint_every=2, keep_last=10, lr=0.5, out_dir=str(out_dir),
    )  # fmt: skip
    loaders = build_data(config, env, open_source(config), seed=11)
    model = wrap(bn_free_model(), env, gpu_pinned=False)
    optimizer, scheduler = build_optimizer(model, config.optim)
    meta = {"arch": "bn_free", "num_classes": 3, "class_to_idx": loaders.class_to_idx}
    meta["config"] = config.to_dict()
    parts = training_parts(unwrap(model), optimizer, scheduler, env)
    checkpointer = Checkpointer(env, out_dir, parts, meta, {}, keep_last=10, every=2)
    state = TrainState() if resume is None else checkpointer.restore(load(resume))
    with StopRequests(env) as stop:
        run = trainer.Run(
            config, env, loaders, model, optimizer, scheduler,
            Reporter(env, out_dir, "lines"), 11, Precision(), checkpointer, stop,
        )  # fmt: skip
        trainer.fit(run, state)
    return flat_params(model)


def records(out_dir, split):
    lines = (out_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["split"] == split]


@pytest.fixture(scope="module")
def straight(tiny_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("straight")
    (params,) = run_ranks(fit, 1, tiny_data, out)
    return params, out


# Step 2 is mid-epoch 1, step 4 mid-epoch 2.
@pytest.mark.parametrize(("before", "after", "step"), [(2, 1, 2), (1, 2, 4)])
def test_a_mid_epoch_checkpoint_resumes_on_another_world_size(
    tiny_data, tmp_path, straight, before, after, step
):
    straight, straight_dir = straight
    run_ranks(fit, before, tiny_data, tmp_path / "first")
    mid_epoch = tmp_path / "first" / f"checkpoint-{step:09d}.pt"
    assert load(mid_epoch)["epoch_step"] == (1 if step == 4 else 2)
    resumed = run_ranks(fit, after, tiny_data, tmp_path / "resumed", mid_epoch)

    assert not torch.equal(straight, flat_params(bn_free_model()))  # it trained
    for params in resumed:
        torch.testing.assert_close(params, straight, rtol=0, atol=1e-5)
    # The resumed epoch's train record covers the whole epoch, the part before the checkpoint too.
    train = records(tmp_path / "resumed", "train")[-1]
    reference = records(straight_dir, "train")[-1]
    assert train["samples"] == reference["samples"] == 24
    assert train["loss"] == pytest.approx(reference["loss"], abs=1e-5)
    val = records(tmp_path / "resumed", "val")[-1]
    assert val["loss"] == pytest.approx(records(straight_dir, "val")[-1]["loss"], abs=1e-5)
