"""On a real one-node SLURM (conftest's slurm_cluster): ranks started by `srun` train as
torchrun's do, and a job that SLURM signals stops saved and continues exactly, through the
requeue script the docs give (docs/slurm-requeue.sh).

The job steps have a loader worker per rank (-j 1): SLURM signals every process of a step,
workers included. Rank 0 stops itself (SIGSTOP) at a known step, so that the signal lands there.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli import (
    DEADLINE,
    assert_same_training,
    env_with,
    process_state,
    resumable_args,
    training_state,
    wait_pending,
)

REQUEUE_SCRIPT = Path(__file__).parents[2] / "docs" / "slurm-requeue.sh"
REVOKED_CREDENTIAL_SECONDS = 3
STALL_STEP = 5  # mid-epoch 2 of the tiny runs: 3 steps an epoch, a checkpoint every 2


def train_args(data, out):
    return (*resumable_args(data, out), "-j", 1)


def srun_command(data, out) -> list[str]:
    return ["srun", "-n", "2", sys.executable, "-m", "ddptrain", *map(str, train_args(data, out))]


def stall(marker: Path) -> dict:
    """Rank 0 stops itself before global step STALL_STEP, once."""
    return {
        "DDPTRAIN_TEST_KILL": f"between:0:{STALL_STEP}",
        "DDPTRAIN_TEST_KILL_ONCE": str(marker),
        "DDPTRAIN_TEST_SIGNAL": "SIGSTOP",
    }


@pytest.fixture
def cluster(slurm_cluster):
    yield slurm_cluster
    slurm_cluster.cancel_all()  # a failed test leaves no job behind for the next


def test_srun_two_tasks_equal_torchrun_two_ranks(cluster, tiny_data, tmp_path, uninterrupted):
    out = tmp_path / "run"
    result = cluster.run(*srun_command(tiny_data, out), timeout=DEADLINE)
    assert result.returncode == 0, result.stderr
    assert "2 rank(s) = 1 node(s) x 2" in result.stdout
    assert_same_training(uninterrupted, out)


def test_scancel_term_stops_saved_and_srun_resume_auto_ends_bitwise_equal(
    cluster, tiny_data, tmp_path, uninterrupted
):
    out, log = tmp_path / "run", tmp_path / "srun.err"
    with log.open("w") as stderr:
        step = subprocess.Popen(
            srun_command(tiny_data, out),
            env=env_with(**cluster.env, **stall(tmp_path / "marker")),
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )
    try:
        stalled = _wait_for(lambda: _stopped_rank(tmp_path), "rank 0 stopped", log)
        (job,) = cluster.jobs()
        assert cluster.run("scancel", "--signal", "TERM", job).returncode == 0
        wait_pending(stalled, signal.SIGTERM)
        os.kill(stalled, signal.SIGCONT)
        step.wait(timeout=DEADLINE)
    finally:
        step.kill()
    stderr = log.read_text()
    assert step.returncode == 0, stderr
    assert stderr.count(f"stopped by SIGTERM after global step {STALL_STEP} ") == 2, stderr
    assert training_state(out)["global_step"] == STALL_STEP
    resumed = cluster.run(*srun_command(tiny_data, out), timeout=DEADLINE)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from {out}/checkpoint-{STALL_STEP:09d}.pt" in resumed.stdout
    assert_same_training(uninterrupted, out)


def test_the_requeue_script_stops_requeues_and_finishes_bitwise_equal(
    cluster, tiny_data, tmp_path, uninterrupted
):
    """docs/slurm-requeue.sh on one node with 2 CPU ranks; the time limit's warning is sent
    at once by `scancel -b -s USR1`."""
    script = tmp_path / "requeue.sh"
    script.write_text(_one_node_of_cpus(REQUEUE_SCRIPT.read_text()))
    out, log = tmp_path / "run", tmp_path / "job.out"
    env = env_with(
        **cluster.env,
        **stall(tmp_path / "marker"),
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",  # torchrun
    )
    data_args = train_args(tiny_data, out)[1:]  # what follows `train`
    submitted = subprocess.run(
        ["sbatch", "--parsable", f"--output={log}", str(script), *map(str, data_args)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert submitted.returncode == 0, submitted.stderr
    job = submitted.stdout.strip().split(";")[0]
    stalled = _wait_for(lambda: _stopped_rank(tmp_path), "rank 0 stopped", log)
    assert cluster.run("scancel", "--batch", "--signal", "USR1", job).returncode == 0
    wait_pending(stalled, signal.SIGTERM)
    os.kill(stalled, signal.SIGCONT)
    _wait_for(lambda: (cluster.job_state(job) or "").startswith("PENDING"), "the requeue", log)
    # SLURM holds a requeued batch job back for a while (120 s, SLURM 22.05); let go within the
    # second of the requeue, it met its own revoked credential ("Job credential revoked").
    time.sleep(REVOKED_CREDENTIAL_SECONDS)
    _wait_for(lambda: _released(cluster, job), "the requeued job's start", log)
    _wait_for(lambda: cluster.job_state(job) == "", "the requeued job's end", log)
    text = log.read_text() + cluster.logs()
    assert text.count(f"stopped by SIGTERM after global step {STALL_STEP} ") == 2, text
    assert f"resumed from {out}/checkpoint-{STALL_STEP:09d}.pt" in text, text
    assert "DataLoader worker" not in text
    assert_same_training(uninterrupted, out)


def _released(cluster, job: str) -> bool:
    """Whether the requeued job started; if not, it is let go now."""
    state = cluster.job_state(job)
    if state is None or state.startswith("PENDING"):
        cluster.run("scontrol", "update", f"JobId={job}", "StartTime=now")
        return False
    return True


def _one_node_of_cpus(script: str) -> str:
    """The script for one node with 2 CPU ranks, as this machine has."""
    for gpu_setting, cpu_setting in [
        ("--nodes=2", "--nodes=1"),
        ("--gpus-per-node=8", "--cpus-per-task=2"),
        ("--nproc-per-node 8", "--nproc-per-node 2"),
    ]:
        assert gpu_setting in script, gpu_setting
        script = script.replace(gpu_setting, cpu_setting)
    return script


def _stopped_rank(folder: Path) -> int | None:
    """The pid of a rank stopped by SIGSTOP whose command names folder, if one is (SLURM
    starts the ranks, not the test)."""
    for process in Path("/proc").glob("[0-9]*"):
        try:
            cmdline = (process / "cmdline").read_bytes()
        except OSError:
            continue
        if str(folder).encode() in cmdline and process_state(process.name) == "T":
            return int(process.name)
    return None


def _wait_for(ready, what: str, log: Path, timeout: float = DEADLINE):
    deadline = time.monotonic() + timeout
    while not (found := ready()):
        assert time.monotonic() < deadline, f"waited for {what}: {_read(log)}"
        time.sleep(0.2)
    return found


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else "(no output yet)"
