"""SLURM's variables, read as srun sets them and its nodelists expanded as scontrol would."""

import pytest

from ddptrain.distributed.slurm import expand_nodelist, placement, started_by_srun, tasks_per_node
from ddptrain.errors import UserError


@pytest.mark.parametrize(
    ("nodelist", "hosts"),
    [
        ("solo", ["solo"]),
        ("a,b,c", ["a", "b", "c"]),
        ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
        ("node[8-11]", ["node8", "node9", "node10", "node11"]),
        ("gpu[1,3],cpu5", ["gpu1", "gpu3", "cpu5"]),
        ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
        ("a-b.example.org", ["a-b.example.org"]),
    ],
)
def test_nodelists_expand_as_scontrol_show_hostnames(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("bad", ["node[01-03", "node[a-b]"])
def test_unreadable_nodelists_are_named(bad):
    with pytest.raises(UserError, match="SLURM_STEP_NODELIST"):
        expand_nodelist(bad)


def test_tasks_per_node():
    assert tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert tasks_per_node("4") == [4]
    with pytest.raises(UserError, match="SLURM_TASKS_PER_NODE"):
        tasks_per_node("two")


def srun_env(**extra) -> dict:
    """What srun gives task 3 of a 4-task step on nodes n3 and n4."""
    base = dict(
        SLURM_PROCID="3",
        SLURM_LOCALID="1",
        SLURM_STEP_NUM_TASKS="4",
        SLURM_STEP_NODELIST="n[3-4]",
        SLURM_STEP_ID="0",
    )
    return {**base, **extra}


def test_placement_of_an_srun_task():
    task = placement(
        srun_env(SLURM_STEP_TASKS_PER_NODE="2(x2)", SLURM_NODEID="1", SLURM_JOB_ID="7")
    )
    assert (task.rank, task.world_size, task.local_rank, task.local_world_size) == (3, 4, 1, 2)
    assert task.url == "tcp://n3:12007"  # first host; a port from the job id
    given = placement(srun_env(MASTER_ADDR="head", MASTER_PORT="29500", SLURM_NTASKS_PER_NODE="2"))
    assert given.url == "tcp://head:29500" and given.local_world_size == 2


def test_a_step_of_a_larger_job_meets_on_its_own_hosts_and_port():
    """Two steps of one job at once (a sweep): each meets at its first host on its own port."""
    job = dict(SLURM_JOB_ID="7", SLURM_JOB_NODELIST="n[1-4]", SLURM_NTASKS="16")
    first, second = (placement(srun_env(**job, SLURM_STEP_ID=step)) for step in ("0", "1"))
    assert first.world_size == second.world_size == 4
    assert first.master_addr == "n3" and first.master_port != second.master_port


def test_only_several_srun_tasks_count():
    assert started_by_srun(srun_env())
    assert not started_by_srun(srun_env(SLURM_STEP_NUM_TASKS="1"))  # a one-task step
    # A batch script's own process: rank 0 of the job's 8 tasks by its variables, yet alone.
    batch = dict(SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NTASKS="8", SLURM_JOB_NODELIST="n1")
    assert not started_by_srun(batch)
    assert not started_by_srun({"SLURM_JOB_ID": "7"})  # inside an allocation, not srun
