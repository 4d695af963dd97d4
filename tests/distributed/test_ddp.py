import pytest
import torch
from harness import run_ranks
from torch import nn

from ddptrain.config import Config
from ddptrain.data.loaders import build_data
from ddptrain.data.sources import open_source
from ddptrain.distributed.collectives import agree, check_same, from_rank0, rank0_first
from ddptrain.errors import UserError
from ddptrain.model.build import build_model
from ddptrain.model.precision import Precision
from ddptrain.parallel.parallelize import unwrap, wrap
from ddptrain.report.metrics import EvalSums
from ddptrain.train import trainer
from ddptrain.train.step import Step


def flat_params(model):
    return torch.cat([p.detach().flatten() for p in unwrap(model).parameters()])


def one_step_with_rank_specific_data(env):
    torch.manual_seed(100 + env.rank)  # different initial weights: DDP must broadcast rank 0's
    model = wrap(build_model("resnet18", 3, 16, False), env, gpu_pinned=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    images, target = torch.randn(4, 3, 16, 16), torch.randint(0, 3, (4,))
    Step(model, optimizer)(images, target)
    return flat_params(model)


def test_parameters_are_identical_on_both_ranks_after_a_step():
    a, b = run_ranks(one_step_with_rank_specific_data, 2)
    assert torch.equal(a, b)


def gradients_of_backward(env, count, example):
    """The reduced gradients of this rank's batch at the `count`th backward of a freshly
    wrapped resnet18, the weights unchanged in between (only DDP's bucket layout may change)."""
    torch.manual_seed(0)
    model = build_model("resnet18", 3, 16, False)
    ddp = wrap(model, env, example=torch.zeros(2, 3, 16, 16) if example else None)
    images = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(env.rank))
    for _ in range(count):
        ddp.zero_grad(set_to_none=True)
        ddp(images).sum().backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def test_on_three_ranks_the_first_step_reduces_as_the_later_ones():
    """What makes a resumed run's first step bitwise the uninterrupted run's: DDP re-lays its
    buckets after the first backward, and on 3 ranks the all-reduce's sums follow the layout."""
    first, second = (run_ranks(gradients_of_backward, 3, n, True) for n in (1, 2))
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    unprimed = run_ranks(gradients_of_backward, 3, 1, False)
    assert not all(torch.equal(a, b) for a, b in zip(unprimed, second, strict=True))


def gradients_of_accumulated_step(env, count):
    """The reduced gradients of the `count`th optimizer step of two micro-batches, on resnet18
    wrapped as a run wraps it, the weights unchanged in between (lr 0)."""
    torch.manual_seed(0)
    model = build_model("resnet18", 3, 16, False)
    ddp = wrap(model, env, example=torch.zeros(2, 3, 16, 16))
    step = Step(ddp, torch.optim.SGD(ddp.parameters(), lr=0.0), accum_steps=2)
    generator = torch.Generator().manual_seed(env.rank)
    images, target = torch.randn(4, 3, 16, 16, generator=generator), torch.tensor([0, 1, 2, 0])
    for _ in range(count):
        step(images, target)
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def test_on_three_ranks_a_first_accumulated_step_reduces_as_the_later_ones():
    """Accumulating, the gradients are zeroed in DDP's buckets (train.step): DDP then averages
    them in place, where a gradient beside its bucket is copied in and scaled otherwise, and on
    3 ranks the two differ in the last bit. A resumed run's first step must take the later
    steps' path: the buckets' layout leaves the gradients in them (lay_out_buckets)."""
    first, second = (run_ranks(gradients_of_accumulated_step, 3, n) for n in (1, 2))
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


def bn_free_model():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 3)
    )


def train_one_epoch(env, root):
    config = Config(data=str(root), batch_size=8, workers=0, image_size=16)
    loaders = build_data(config, env, open_source(config), seed=11)
    model = wrap(bn_free_model(), env, gpu_pinned=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    loaders.train_sampler.set_epoch(0)
    for images, target in loaders.train_loader:
        images = Precision().inputs(images, env.device)  # uint8 batches, normalised as in training
        Step(model, optimizer)(images, target)
    return flat_params(model)


def test_two_ranks_equal_one_process_with_the_same_global_batch(tiny_data):
    (single,) = run_ranks(train_one_epoch, 1, tiny_data)
    first, second = run_ranks(train_one_epoch, 2, tiny_data)
    assert torch.equal(first, second)
    assert not torch.equal(single, bn_free_model_params())  # it trained
    torch.testing.assert_close(first, single, rtol=0, atol=1e-5)


def bn_free_model_params():
    return torch.cat([p.detach().flatten() for p in bn_free_model().parameters()])


def evaluate(env, root, batch_size=6):
    config = Config(data=str(root), batch_size=batch_size, workers=0, image_size=16)
    loaders = build_data(config, env, open_source(config), seed=0)
    torch.manual_seed(0)
    model = wrap(build_model("resnet18", 3, 16, False), env)  # DDP on 2+ ranks
    return trainer.evaluate(model, loaders.val_loader, env)


# 15 val images: on 2 ranks shards of 7 and 8, on 3 ranks 5 each, on 4 ranks 3 and 4; 7 or 3
# images a rank leave the short shard a last batch of padding only.
# The confusion counts ride the same all-reduce, so they are checked here too.
@pytest.mark.parametrize(("world", "batch"), [(2, 6), (3, 6), (2, 14), (4, 12)])
def test_exact_evaluation_on_an_uneven_val_set(tiny_data, world, batch):
    (single,) = run_ranks(evaluate, 1, tiny_data)
    results = run_ranks(evaluate, world, tiny_data, batch)
    assert single["samples"] == 15
    assert_confusion_gives_acc1(single)
    for result in results:  # every rank gets the global figures
        assert result["samples"] == 15
        assert result["acc1"] == single["acc1"] and result["acc5"] == single["acc5"]
        assert result["loss"] == pytest.approx(single["loss"], rel=1e-6)
        assert torch.equal(result["confusion"], single["confusion"])
        assert_confusion_gives_acc1(result)


def confusion_of_a_shard(env, dense_limit):
    """Each rank counts its share of 40 fixed predictions over 6 classes."""
    generator = torch.Generator().manual_seed(0)
    output, target = torch.randn(40, 6, generator=generator), torch.randint(0, 6, (40,))
    mine = slice(env.rank * 40 // env.world_size, (env.rank + 1) * 40 // env.world_size)
    sums = EvalSums(env.device, dense_limit)
    sums.add_masked(torch.tensor(0.0), output[mine], target[mine], target[mine] >= 0)
    return sums.result(env)[1].to_dense()


def test_confusion_cells_gathered_over_ranks_equal_the_dense_counts():
    (dense,) = run_ranks(confusion_of_a_shard, 1, 6)
    for gathered in run_ranks(confusion_of_a_shard, 2, 0):
        assert torch.equal(gathered, dense)
    assert dense.sum() == 40


def assert_confusion_gives_acc1(result):
    """per_class.jsonl's counts: every val image once, in its true class's row (5 a class),
    and the diagonal is the top-1 hits acc1 counts."""
    confusion = result["confusion"]
    assert confusion.dtype == torch.int64 and confusion.shape == (3, 3)
    assert confusion.sum(dim=1).tolist() == [5, 5, 5]
    assert 100 * confusion.diagonal().sum().item() / 15 == result["acc1"]


def outcome(call) -> str:
    """What a rank saw: "ok: <value>", or "<error type>: <message>"."""
    try:
        return f"ok: {call()}"
    except (UserError, KeyError) as err:
        return f"{type(err).__name__}: {err}"


def fails_on_rank_1(env, error):
    def action():
        if env.rank == 1:
            raise error
        return "done"

    return action


def setup_failing_on_rank_1(env):
    return outcome(lambda: agree(env, fails_on_rank_1(env, UserError("no checkpoint"))))


def test_a_setup_error_on_one_rank_is_raised_on_every_rank():
    first, second = run_ranks(setup_failing_on_rank_1, 2)
    assert second == "UserError: no checkpoint"
    assert first.startswith("UserError: another rank failed")


def bug_on_rank_1(env):
    return outcome(lambda: agree(env, fails_on_rank_1(env, KeyError("a bug"))))


def test_any_failure_on_one_rank_ends_every_rank_and_keeps_its_own_type():
    first, second = run_ranks(bug_on_rank_1, 2)
    assert first.startswith("UserError: another rank failed")
    assert second == "KeyError: 'a bug'"


def download_failing_on_rank_1(env):
    fetch = fails_on_rank_1(env, UserError("no network on this node"))
    return outcome(lambda: rank0_first(env, fetch))


def test_a_download_failing_after_rank_0_ends_every_rank():
    first, second = run_ranks(download_failing_on_rank_1, 2)
    assert first.startswith("UserError: another rank failed")
    assert second == "UserError: no network on this node"


def facts_differing_on_rank_1(env):
    facts = {"train images": 100 + env.rank, "classes": {"a": 0}}
    return outcome(lambda: check_same(env, facts))


def test_ranks_that_read_different_data_all_stop():
    first, second = run_ranks(facts_differing_on_rank_1, 2)
    assert first.startswith("UserError: another rank failed")
    assert "rank 1 sees other train images than rank 0" in second


def amp_chosen_by_each_node(env):
    return outcome(lambda: check_same(env, {"--amp": ("bf16", "none")[env.rank]}, "give --amp"))


def test_ranks_whose_hardware_chose_another_precision_all_stop():
    first, second = run_ranks(amp_chosen_by_each_node, 2)
    assert first.startswith("UserError: another rank failed")
    assert second == "UserError: rank 1 sees other --amp than rank 0: give --amp"


def decided_by_rank_0(env):
    return from_rank0(env, lambda: f"rank {env.rank} decides")


def test_rank_0_decides_for_all():
    assert run_ranks(decided_by_rank_0, 3) == ["rank 0 decides"] * 3
