"""Finished runs that several tests start from, each trained once per session.

Read one in place, or `copy_run` it into the test's own folder to train on or change it: a
test never writes into these.
"""

import pytest
import slurm
from cli import ddptrain, ok, resumable_args, tiny_args, torchrun, training_state


@pytest.fixture(scope="session")
def one_rank_run(tiny_data, tmp_path_factory, cache_env):
    """`ddptrain train` on one process: one epoch of tiny_args."""
    out = tmp_path_factory.mktemp("one-rank-run") / "run"
    ok(ddptrain("train", *tiny_args(tiny_data, out), env=cache_env))
    return out


@pytest.fixture(scope="session")
def two_rank_run(tiny_data, tmp_path_factory, cache_env):
    """The same under torchrun on 2 ranks."""
    out = tmp_path_factory.mktemp("two-rank-run") / "run"
    ok(torchrun(2, "train", *tiny_args(tiny_data, out), env=cache_env))
    return out


@pytest.fixture(scope="session")
def uninterrupted(tiny_data, tmp_path_factory, cache_env):
    """resumable_args under torchrun on 2 ranks, uninterrupted: what killed, stopped and
    resumed runs end equal to."""
    out = tmp_path_factory.mktemp("uninterrupted") / "run"
    ok(torchrun(2, *resumable_args(tiny_data, out), env=cache_env))
    assert training_state(out)["global_step"] == 6
    return out


@pytest.fixture(scope="session")
def slurm_cluster():
    """A one-node SLURM cluster of this machine's cores (slurm.py)."""
    reason = slurm.unavailable()
    if reason:
        slurm.skip_or_fail(reason)
    cluster = slurm.Cluster().start()
    try:
        yield cluster
    finally:
        cluster.stop()
