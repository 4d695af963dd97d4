"""Runs the real ddptrain CLI in subprocesses, under each launcher, with a deadline."""

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from ddptrain.distributed.ports import free_port
from ddptrain.state import sharded

DEADLINE = 240  # seconds: a hang fails the test instead of stalling CI
# The crop of tests that train in bf16. At tiny_args' 16 px, resnet18's layer4 convolves 1x1
# maps, where oneDNN's bf16 backward (torch 2.14.1, on an AVX512 CPU without native bf16)
# now and then writes non-finite values into layer4.0.conv1's weight gradient; at 32 px the
# map is 2x2 and that was never seen.
BF16_CROP = 32


def env_with(**extra) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", **extra}


def tiny_args(data, out, *extra) -> list[str]:
    """A resnet18 on 16 px crops of the tiny dataset: seconds per epoch."""
    return [
        str(data),
        "--image-size",
        "16",
        "-b",
        "8",
        "-j",
        "0",
        "--epochs",
        "1",
        "--seed",
        "0",
        "-p",
        "1",
        "--out-dir",
        str(out),
        *map(str, extra),
    ]


def resumable_args(data, out, checkpoint_every=2, epochs=2) -> tuple:
    """`train` with tiny_args for 2 epochs of 3 steps, a checkpoint every 2 (global steps 2
    and 4) and at each epoch's end (3 and 6), resuming what out-dir holds."""
    return (
        *("train", *tiny_args(data, out), "--resume", "auto"),
        *("--epochs", epochs, "--checkpoint-every", checkpoint_every),
    )


def ddptrain(*args, timeout=DEADLINE, env=None) -> subprocess.CompletedProcess:
    return _run([sys.executable, "-m", "ddptrain", *map(str, args)], timeout, env)


def torchrun_command(nproc: int, *args, restarts: int = 0) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        f"--max-restarts={restarts}",
        "-m",
        "ddptrain",
        *map(str, args),
    ]


def torchrun(
    nproc: int, *args, timeout=DEADLINE, env=None, restarts: int = 0
) -> subprocess.CompletedProcess:
    return _run(torchrun_command(nproc, *args, restarts=restarts), timeout, env)


def launch(nproc: int, *args, timeout=DEADLINE) -> subprocess.CompletedProcess:
    """The deprecated torch.distributed.launch, which passes --local-rank=N before the command."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.launch",
        f"--nproc-per-node={nproc}",
        f"--master-port={free_port()}",
        "-m",
        "ddptrain",
        *map(str, args),
    ]
    return _run(cmd, timeout)


def tcp_pair(
    *args, timeout=DEADLINE, rank_args=None, env=None
) -> list[subprocess.CompletedProcess]:
    """Two independent invocations meeting at --dist-url tcp://; rank_args: extra arguments of
    one rank, by rank; env: extra environment variables of both."""
    return finished(tcp_pair_started(*args, rank_args=rank_args, env=env), timeout)


def finished(procs: list[subprocess.Popen], timeout=DEADLINE) -> list[subprocess.CompletedProcess]:
    """What each of procs (run together, text pipes) printed once all ended; killed if not."""
    done = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    finally:
        for p in procs:
            p.kill()
    return done


def tcp_pair_started(*args, rank_args=None, env=None) -> list[subprocess.Popen]:
    """tcp_pair's two invocations, running: the caller waits for them and kills them."""
    url = f"tcp://127.0.0.1:{free_port()}"
    return [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "ddptrain",
                *map(str, args),
                "--dist-url",
                url,
                "--world-size",
                "2",
                "--rank",
                str(rank),
                *map(str, (rank_args or {}).get(rank, ())),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env_with(**(env or {})),
        )
        for rank in range(2)
    ]


def kill_tree(pid: int, timeout: float = 60) -> None:
    """SIGKILLs pid and every process below it, and waits until they are dead. A kill of
    torchrun's process group is not enough: torchrun starts each worker in a session of its
    own. Reads Linux's /proc."""
    victims = [pid, *_descendants(pid)]
    for victim in victims:
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    while any(_alive(victim) for victim in victims):
        assert time.monotonic() < deadline, "killed processes still alive"
        time.sleep(0.1)


def signal_tree(pid: int, signum: int) -> None:
    """Sends signum to pid and every process below it, loader workers included, as SLURM
    signals every process of a job step."""
    for victim in [pid, *_descendants(pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim, signum)


def wait_stopped(job: subprocess.Popen, timeout: float = DEADLINE) -> int:
    """Waits until a process below job's is stopped (SIGSTOP: state T), and returns it."""
    deadline = time.monotonic() + timeout
    while not (stopped := [p for p in _descendants(job.pid) if process_state(p) == "T"]):
        assert job.poll() is None, f"the job ended first (exit {job.returncode})"
        if time.monotonic() > deadline:
            raise AssertionError(f"no process of the job stopped\n{stacks_then_kill(job)}")
        time.sleep(0.05)
    return stopped[0]


def ended(job: subprocess.Popen, timeout: float = DEADLINE) -> tuple[str, str]:
    """The job's (stdout, stderr) once it ends; a job still running after timeout seconds
    fails the test with its processes' stacks."""
    try:
        return job.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        message = f"the job did not end within {timeout:.0f} s\n{stacks_then_kill(job)}"
        raise AssertionError(message) from None


def stacks_then_kill(job: subprocess.Popen) -> str:
    """What a hung job's processes were doing (py-spy's dump of each, with native frames where
    py-spy can unwind them, and each thread's kernel wait channel), then the job killed and its
    stderr: for the failure message of a hang."""
    dumps = [
        f"--- process {pid} (child of {(_stat_fields(pid) or ['', '?'])[1]}):\n{_stack(pid)}"
        for pid in [job.pid, *_descendants(job.pid)]
    ]
    kill_tree(job.pid)
    _, stderr = job.communicate()
    return "\n".join([*dumps, f"--- the job's stderr:\n{stderr}"])


def _stack(pid: int) -> str:
    spy = [Path(sys.executable).with_name("py-spy"), "dump", "--pid", str(pid)]
    waits = ", ".join(
        f"{task.name} {process_state(f'{pid}/task/{task.name}')}:{_read(task / 'wchan')}"
        for task in sorted(Path(f"/proc/{pid}/task").glob("*"))
    )
    for command in ([*spy, "--native"], spy):  # native unwinding fails now and then
        try:
            dump = subprocess.run(command, capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired) as err:
            return f"no stack ({err}); threads' wait channels: {waits}"
        if dump.returncode == 0:
            return f"{dump.stdout}threads' wait channels: {waits}"
    return f"{dump.stdout}{dump.stderr}threads' wait channels: {waits}"


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return "?"


def wait_pending(pid: int, signum: int, timeout: float = 30) -> None:
    """Waits until signum is pending for process pid (a stopped process keeps it so)."""
    deadline = time.monotonic() + timeout
    while True:
        status = Path(f"/proc/{pid}/status").read_text()
        pending = int(re.search(r"^ShdPnd:\s*([0-9a-f]+)", status, re.M)[1], 16)
        if pending & (1 << (signum - 1)):
            return
        assert time.monotonic() < deadline, f"signal {signum} never reached process {pid}"
        time.sleep(0.05)


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        fields = _stat_fields(stat.parent.name)
        if fields:
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        below = children.get(todo.pop(), [])
        found += below
        todo += below
    return found


def _alive(pid: int) -> bool:
    """Not yet dead: a zombie has exited (and released its files and locks)."""
    return process_state(pid) not in ("", "Z", "X")


def process_state(pid: int | str) -> str:
    """The process's state letter in /proc (R, S, T, Z, ...), "" for none."""
    return (_stat_fields(pid) or [""])[0]


def _stat_fields(pid: int | str) -> list[str]:
    """The fields of /proc/PID/stat after the command's name (state, parent, ...); [] for a
    process that is gone. PID may be "PID/task/TID", a thread."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def _run(cmd, timeout, env=None) -> subprocess.CompletedProcess:
    job = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env_with(**(env or {})),
    )
    stdout, stderr = ended(job, timeout)  # a hang fails with the stacks of its processes
    return subprocess.CompletedProcess(cmd, job.returncode, stdout, stderr)


def ok(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    return result


def weights(out_dir) -> dict[str, torch.Tensor]:
    return torch.load(out_dir / "checkpoint.pt", weights_only=True)["model"]


def assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def training_state(out_dir) -> dict:
    """The newest checkpoint in out_dir, a sharded one gathered into the single-file dict."""
    if (out_dir / sharded.LATEST).exists():
        return sharded.to_single(out_dir / sharded.LATEST)
    return torch.load(out_dir / "checkpoint.pt", weights_only=True)


def val_records(out_dir, split: str = "val") -> list[dict]:
    """The metrics.jsonl records of `split` ("val", or "val_ema" for the EMA's)."""
    lines = (out_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["split"] == split]


def _flat_optimizer(ckpt: dict) -> dict[str, torch.Tensor]:
    return {f"{k}.{n}": v for k, s in ckpt["optimizer"]["state"].items() for n, v in s.items()}


def assert_same_training(a_dir, b_dir, epochs_in_b: int | None = None) -> None:
    """Bitwise the same model, optimizer, schedule, progress and EMA (with --model-ema), and the
    same val records (of the last `epochs_in_b` epochs, where b_dir's run resumed another
    out-dir's checkpoint)."""
    a, b = training_state(a_dir), training_state(b_dir)
    assert (a["epoch"], a["global_step"]) == (b["epoch"], b["global_step"])
    assert_same_weights(a["model"], b["model"])
    assert_same_weights(_flat_optimizer(a), _flat_optimizer(b))
    assert a["scheduler"] == b["scheduler"] and a["best_acc1"] == b["best_acc1"]
    assert ("model_ema" in a) == ("model_ema" in b)
    if "model_ema" in a:
        assert_same_weights(a["model_ema"]["model"], b["model_ema"]["model"])
        assert a["model_ema"]["updates"] == b["model_ema"]["updates"]
    for split in ("val", "val_ema"):
        expected = val_records(a_dir, split)
        if epochs_in_b is not None:
            expected = expected[len(expected) - epochs_in_b :]
        assert expected == val_records(b_dir, split)


def copy_run(run: Path, to: Path) -> Path:
    """A finished run's out-dir (conftest's one_rank_run, two_rank_run) copied to `to`, to
    resume or change there."""
    return Path(shutil.copytree(run, to))
