"""A packed set on several ranks: the same global order (world-size invariance) and exact
evaluation as the folder it was packed from, with batches and val shards that cross shards."""

import torch
from harness import run_ranks
from test_ddp import evaluate, train_one_epoch


def test_two_ranks_on_a_packed_set_equal_one_process_on_its_folder(tiny_data, tiny_packed):
    (folder,) = run_ranks(train_one_epoch, 1, tiny_data)
    first, second = run_ranks(train_one_epoch, 2, tiny_packed)
    assert torch.equal(first, second)
    torch.testing.assert_close(first, folder, rtol=0, atol=1e-5)


def test_exact_evaluation_of_a_packed_set_on_three_ranks(tiny_data, tiny_packed):
    (folder,) = run_ranks(evaluate, 1, tiny_data)
    for result in run_ranks(evaluate, 3, tiny_packed, 6):
        assert result["samples"] == 15
        assert (result["acc1"], result["acc5"]) == (folder["acc1"], folder["acc5"])
