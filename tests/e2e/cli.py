"""Runs the real ddptrain CLI in subprocesses, under each launcher, with a deadline."""

import os
import socket
import subprocess
import sys

import torch

DEADLINE = 240  # seconds: a hang fails the test instead of stalling CI


def _env(**extra) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", **extra}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def ddptrain(*args, timeout=DEADLINE, env=None) -> subprocess.CompletedProcess:
    return _run([sys.executable, "-m", "ddptrain", *map(str, args)], timeout, env)


def torchrun(nproc: int, *args, timeout=DEADLINE, env=None) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "ddptrain",
        *map(str, args),
    ]
    return _run(cmd, timeout, env)


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


def tcp_pair(*args, timeout=DEADLINE) -> list[subprocess.CompletedProcess]:
    """Two independent invocations meeting at --dist-url tcp://."""
    url = f"tcp://127.0.0.1:{free_port()}"
    procs = [
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
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_env(),
        )
        for rank in range(2)
    ]
    done = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    finally:
        for p in procs:
            p.kill()
    return done


def _run(cmd, timeout, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, env=_env(**(env or {}))
    )


def ok(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    return result


def weights(out_dir) -> dict[str, torch.Tensor]:
    return torch.load(out_dir / "checkpoint.pt", weights_only=True)["model"]


def assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
