"""Multi-node on one machine: two torchrun agents (one "node" each) and two srun-started tasks
(SLURM's variables faked) each equal a single-agent 2-rank run, weight for weight."""

import subprocess
import sys

import pytest
from cli import (
    assert_same_training,
    assert_same_weights,
    env_with,
    finished,
    ok,
    tiny_args,
    torchrun,
    weights,
)

from ddptrain.distributed.ports import free_port


@pytest.fixture(scope="module")
def one_agent(two_rank_run):
    return weights(two_rank_run)


def run_together(commands: list[list[str]], envs: list[dict]) -> list[subprocess.CompletedProcess]:
    procs = [
        subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        for cmd, env in zip(commands, envs, strict=True)
    ]
    return finished(procs)


def test_two_torchrun_agents_equal_one_agent_with_two_ranks(tiny_data, tmp_path, one_agent):
    endpoint = f"127.0.0.1:{free_port()}"
    agents = [
        [
            *(sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={node}"),
            *("--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}"),
            *("--rdzv-id=ddptrain-test", "--local-addr=127.0.0.1"),
            *("-m", "ddptrain", "train", *tiny_args(tiny_data, tmp_path)),
        ]
        for node in range(2)
    ]
    results = run_together(agents, [env_with()] * 2)
    for result in results:
        ok(result)
    assert "2 rank(s) = 2 node(s) x 1" in "".join(r.stdout for r in results)
    assert_same_weights(weights(tmp_path), one_agent)


def test_two_srun_tasks_equal_one_agent_with_two_ranks(tiny_data, tmp_path, one_agent):
    command = [sys.executable, "-m", "ddptrain", "train", *tiny_args(tiny_data, tmp_path)]
    port = str(free_port())
    tasks = [
        env_with(
            SLURM_PROCID=str(rank),
            SLURM_LOCALID=str(rank),
            SLURM_STEP_NUM_TASKS="2",
            SLURM_STEP_TASKS_PER_NODE="2",
            SLURM_STEP_NODELIST="localhost",
            SLURM_STEP_ID="0",
            SLURM_JOB_ID="1234",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
        )
        for rank in range(2)
    ]
    results = run_together([command, command], tasks)
    for result in results:
        ok(result)
    assert "2 rank(s) = 1 node(s) x 2" in results[0].stdout and not results[1].stdout
    assert_same_weights(weights(tmp_path), one_agent)


def test_a_killed_rank_of_two_agents_restarts_and_ends_bitwise_equal(tiny_data, tmp_path):
    """--max-restarts across agents: each restart attempt gets a fresh rendezvous store
    (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, as docs/faults.md says), and the run resumes from its
    checkpoint."""
    train = ("train", *tiny_args(tiny_data, tmp_path / "killed"), "--epochs", 2)
    train = (*train, "--checkpoint-every", 2, "--resume", "auto")
    endpoint, marker = f"127.0.0.1:{free_port()}", tmp_path / "fired"
    agents = [
        [
            *(sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={node}"),
            *("--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}"),
            *("--rdzv-id=ddptrain-restart", "--local-addr=127.0.0.1", "--max-restarts=2"),
            *("-m", "ddptrain", *map(str, train)),
        ]
        for node in range(2)
    ]
    env = env_with(
        TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
        DDPTRAIN_TEST_KILL="data:1:5",
        DDPTRAIN_TEST_KILL_ONCE=str(marker),
    )
    results = run_together(agents, [env] * 2)
    for result in results:
        ok(result)
    assert marker.exists(), "the fault never fired"
    out = "".join(r.stdout for r in results)
    assert f"resumed from {tmp_path / 'killed'}/checkpoint-000000004.pt" in out
    reference = ("train", *tiny_args(tiny_data, tmp_path / "whole"), "--epochs", 2)
    ok(torchrun(2, *reference, "--checkpoint-every", 2, "--resume", "auto"))
    assert_same_training(tmp_path / "whole", tmp_path / "killed")
