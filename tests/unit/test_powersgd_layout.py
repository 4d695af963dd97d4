"""How PowerSGD's flat state is laid out by parameter order (model/comm_hooks.py); the resume
it serves is checked on real ranks in tests/distributed/test_comm_hooks.py."""

import torch
from torch import nn

from ddptrain.model.comm_hooks import LaidOutPowerSGDState, _reorder

SHAPES = [(8, 3, 3, 3), (8, 8, 3, 3), (8,), (16, 8, 1, 1), (8, 8, 3, 3)]


def state() -> LaidOutPowerSGDState:
    params = [nn.Parameter(torch.zeros(shape)) for shape in SHAPES]
    return LaidOutPowerSGDState(
        params, process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=2
    )


def test_memory_slots_group_the_matrices_by_shape_in_order_of_appearance():
    # (parameter, P length n*r, Q length m*r); the bias is not worth compressing
    assert state()._memory_slots([0, 1, 2, 3, 4]) == [
        (0, 16, 54),
        (1, 16, 144),
        (4, 16, 144),
        (3, 32, 16),
    ]
    assert [i for i, _, _ in state()._memory_slots([4, 3, 2, 1, 0])] == [4, 1, 3, 0]


def test_reorder_moves_whole_slices_and_back():
    flat = torch.arange(6.0)  # parameter 7: [0, 1, 2], parameter 5: [3], parameter 9: [4, 5]
    slices = [(7, 3), (5, 1), (9, 2)]
    moved = _reorder(flat, slices, [9, 7, 5])
    assert moved.tolist() == [4, 5, 0, 1, 2, 3]
    assert torch.equal(_reorder(moved, [(9, 2), (7, 3), (5, 1)], [7, 5, 9]), flat)
