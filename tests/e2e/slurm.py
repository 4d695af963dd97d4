"""A real one-node SLURM cluster on this machine, for the tests: munged, slurmctld and slurmd
with their own key, socket, ports and state in a temporary folder, started in seconds.

Debian's `slurm-wlm` and `munge` provide them (.ci/run installs them); they run as root here.
Where they cannot be had, the tests skip with the reason, except under CI (CI set), where
that is a failure: CI must run them.
"""

import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from ddptrain.distributed.ports import free_port

PROGRAMS = ("munged", "slurmctld", "slurmd", "srun", "sbatch", "scancel", "scontrol", "squeue")
START_TIMEOUT = 30  # seconds; the cluster starts in about one


def unavailable() -> str | None:
    """Why no cluster can be started here, or None."""
    missing = [p for p in PROGRAMS if shutil.which(p) is None]
    if missing:
        missing = ", ".join(missing)
        return f"SLURM is not installed (no {missing}: apt-get install slurm-wlm munge)"
    if os.geteuid() != 0:
        return "the test cluster's daemons run as root"
    return None


def skip_or_fail(reason: str) -> None:
    if os.environ.get("CI", "").lower() not in ("", "0", "false"):
        pytest.fail(f"SLURM tests must run under CI: {reason}")
    pytest.skip(reason)


class Cluster:
    """Start with start(), end with stop(). `env`: the variables its commands need."""

    def __init__(self):
        # Not under pytest's base temp: munged wants every folder above its socket open to all.
        self.root = Path(tempfile.mkdtemp(prefix="ddptrain-slurm-"))
        self.root.chmod(0o755)
        self.node = socket.gethostname().split(".")[0]
        self.env = {"SLURM_CONF": str(self.root / "slurm.conf")}
        self.daemons: list[subprocess.Popen] = []

    def start(self) -> "Cluster":
        try:
            return self._start()
        except BaseException:
            self.stop()  # the daemons already started
            raise

    def _start(self) -> "Cluster":
        for folder in ("state", "spool"):
            (self.root / folder).mkdir()
        key = self.root / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        self._daemon(
            "munged",
            "--foreground",
            f"--socket={self.root / 'munge.socket'}",
            f"--key-file={key}",
            f"--pid-file={self.root / 'munged.pid'}",
            f"--log-file={self.root / 'munged.log'}",
            f"--seed-file={self.root / 'munged.seed'}",
        )
        self._wait(lambda: (self.root / "munge.socket").exists(), "munged")
        self._write_config()
        conf = self.env["SLURM_CONF"]
        self._daemon("slurmctld", "-D", "-i", "-f", conf)
        self._daemon("slurmd", "-D", "-f", conf)
        self._wait(self._node_idle, "slurmctld and slurmd")
        return self

    def stop(self) -> None:
        try:
            self.cancel_all()
        finally:
            self._stop_daemons()

    def _stop_daemons(self) -> None:
        for daemon in reversed(self.daemons):
            daemon.send_signal(signal.SIGTERM)
        for daemon in reversed(self.daemons):
            try:
                daemon.wait(timeout=30)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()
        shutil.rmtree(self.root, ignore_errors=True)

    def run(self, *command, timeout=60) -> subprocess.CompletedProcess:
        """A client command (srun, sbatch, scancel, ...) against this cluster."""
        return subprocess.run(
            [*map(str, command)],
            capture_output=True,
            text=True,
            env={**os.environ, **self.env},
            timeout=timeout,
        )

    def jobs(self) -> list[str]:
        """The ids of the jobs queued or running."""
        deadline = time.monotonic() + START_TIMEOUT
        while (listed := self.run("squeue", "-h", "-o", "%i")).returncode != 0:
            assert time.monotonic() < deadline, f"squeue failed: {listed.stderr}"
            time.sleep(0.5)  # slurmctld busy
        return listed.stdout.split()

    def job_state(self, job: str) -> str | None:
        """The job's state (PENDING, RUNNING, ...) and reason, "" once it has left the queue,
        None when squeue could not tell (slurmctld busy)."""
        listed = self.run("squeue", "-h", "-o", "%i %T %r")
        if listed.returncode != 0:
            return None
        states = dict(line.split(" ", 1) for line in listed.stdout.strip().splitlines())
        return states.get(job, "")

    def cancel_all(self) -> None:
        if self.daemons[1:] and self.jobs():  # slurmctld started
            self.run("scancel", "--full", "--signal", "KILL", *self.jobs())
            self.run("scancel", *self.jobs())
            self._wait(lambda: not self.jobs(), "the jobs' end")

    def _daemon(self, program: str, *args) -> None:
        with open(self.root / f"{program}.out", "w") as log:
            self.daemons.append(
                subprocess.Popen(
                    [program, *args],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env={**os.environ, **self.env},
                )
            )

    def _node_idle(self) -> bool:
        result = self.run("sinfo", "-h", "-o", "%T")
        return result.returncode == 0 and result.stdout.strip() == "idle"

    def _wait(self, ready, what: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while not ready():
            for daemon in self.daemons:
                assert daemon.poll() is None, f"{daemon.args[0]} ended: {self.logs()}"
            assert time.monotonic() < deadline, (
                f"waited {START_TIMEOUT} s for {what}: {self.logs()}"
            )
            time.sleep(0.1)

    def logs(self) -> str:
        return "\n".join(
            f"{log.name}:\n{log.read_text(errors='replace')[-2000:]}"
            for log in sorted(self.root.glob("*.log")) + sorted(self.root.glob("*.out"))
        )

    def _write_config(self) -> None:
        root = self.root
        # Each cluster its own job ids: ddptrain derives srun tasks' meeting port from them,
        # and two clusters (the tests run two at a time) must not meet at one.
        first_job = random.SystemRandom().randrange(1, 1_000_000)
        (root / "slurm.conf").write_text(
            f"""\
ClusterName=ddptrain{first_job}
SlurmctldHost={self.node}(127.0.0.1)
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root / "munge.socket"}
FirstJobId={first_job}
StateSaveLocation={root / "state"}
SlurmdSpoolDir={root / "spool"}
SlurmctldPidFile={root / "slurmctld.pid"}
SlurmdPidFile={root / "slurmd.pid"}
SlurmctldLogFile={root / "slurmctld.log"}
SlurmdLogFile={root / "slurmd.log"}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
NodeName={self.node} NodeAddr=127.0.0.1 CPUs={os.cpu_count()} State=UNKNOWN
PartitionName=test Nodes={self.node} Default=YES MaxTime=INFINITE State=UP
"""
        )
