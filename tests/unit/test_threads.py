"""How many intra-op threads a rank takes, and whose OMP_NUM_THREADS counts."""

import os

import pytest
import torch

from ddptrain.distributed.threads import (
    cpu_threads,
    share_cpu_threads,
    too_many_workers,
    user_set_threads,
)

TORCHRUN = {"TORCHELASTIC_RUN_ID": "none", "LOCAL_WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"}


@pytest.mark.parametrize(
    ("cores", "local_ranks", "workers", "threads"),
    [
        (2, 1, 2, 2),  # small machines keep every core for the math
        (2, 2, 0, 1),
        (8, 2, 4, 3),  # 4 cores a rank, one left to its workers
        (32, 1, 4, 28),
        (64, 8, 4, 6),
        (96, 8, 16, 9),  # workers take at most a quarter of the share
        (16, 1, 0, 16),
        (3, 4, 4, 1),  # more ranks than cores: still one thread each
    ],
)
def test_ranks_share_the_cores_and_leave_some_to_their_workers(
    cores, local_ranks, workers, threads
):
    assert cpu_threads(cores, local_ranks, workers) == threads


def test_an_explicit_setting_is_the_users():
    assert not user_set_threads({}, None)
    assert user_set_threads({"OMP_NUM_THREADS": "4"}, None)
    assert user_set_threads({"OMP_NUM_THREADS": "1"}, {"PATH"})  # no launcher
    assert user_set_threads({**TORCHRUN, "OMP_NUM_THREADS": "3"}, {"PATH"})


def test_torchrun_default_is_told_apart_by_its_start_up_environment():
    assert not user_set_threads(TORCHRUN, {"PATH", "HOME"})  # torchrun set it
    assert user_set_threads(TORCHRUN, {"PATH", "OMP_NUM_THREADS"})  # the user gave it to torchrun
    assert user_set_threads(TORCHRUN, None)  # cannot tell: keep what is set


def test_share_sets_threads_unless_the_user_did(monkeypatch):
    chosen = []
    monkeypatch.setattr(torch, "set_num_threads", chosen.append)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    for name in TORCHRUN:
        monkeypatch.delenv(name, raising=False)
    share_cpu_threads(local_world_size=2, workers=4)
    assert chosen == [3]
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    share_cpu_threads(local_world_size=2, workers=4)
    assert chosen == [3]


def test_loader_workers_beyond_the_nodes_cores_are_said_once_for_the_node():
    assert too_many_workers(1, 2, cores=2) is None
    assert too_many_workers(4, 8, cores=64) is None
    line = too_many_workers(4, 2, cores=2)
    assert line.startswith("-j 4: 8 loader workers for the 2 rank(s) on this node, which has 2")
