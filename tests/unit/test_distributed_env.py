"""How each launcher's environment becomes a placement, without starting process groups."""

import datetime
import random
import socket

import pytest
import torch
import torch.distributed as dist

from ddptrain.config import LaunchSettings
from ddptrain.distributed import env, launch, ports
from ddptrain.distributed.env import (
    SpawnSlot,
    _backend,
    _device,
    _placement,
    init_distributed,
    local_index,
)
from ddptrain.distributed.ports import free_port
from ddptrain.errors import UserError

LAUNCHER_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "SLURM_PROCID",
    "SLURM_LOCALID",
    "SLURM_NTASKS",
    "SLURM_STEP_NUM_TASKS",
    "SLURM_STEP_TASKS_PER_NODE",
    "SLURM_STEP_NODELIST",
    "SLURM_STEP_ID",
    "SLURM_NTASKS_PER_NODE",
    "SLURM_TASKS_PER_NODE",
    "SLURM_JOB_NODELIST",
    "SLURM_JOB_ID",
    "SLURM_NODEID",
)


@pytest.fixture(autouse=True)
def no_launcher(monkeypatch):
    for name in LAUNCHER_VARS:
        monkeypatch.delenv(name, raising=False)


def test_single_process():
    assert _placement(LaunchSettings(), None) == (0, 1, 0, 1, "env://")


def test_torchrun_variables_give_each_rank_its_local_device(monkeypatch):
    for name, value in dict(RANK="5", WORLD_SIZE="8", LOCAL_RANK="1", LOCAL_WORLD_SIZE="4").items():
        monkeypatch.setenv(name, value)
    assert _placement(LaunchSettings(), None) == (5, 8, 1, 4, "env://")


def test_torch_distributed_launch_local_rank_flag(monkeypatch):
    monkeypatch.setenv("RANK", "3")  # global rank 3 of 4, local rank 1 on its node
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert _placement(LaunchSettings(local_rank=1), None)[:3] == (3, 4, 1)


def test_spawn_slot_counts_nodes_and_local_processes():
    slot = SpawnSlot(local_rank=2, nproc_per_node=4, node_rank=1, nodes=2, dist_url="tcp://h:1")
    assert _placement(LaunchSettings(), slot) == (6, 8, 2, 4, "tcp://h:1")


def test_tcp_invocations():
    config = LaunchSettings(world_size=2, rank=1, dist_url="tcp://127.0.0.1:5")
    assert _placement(config, None) == (1, 2, 1, 1, "tcp://127.0.0.1:5")
    with pytest.raises(UserError, match="--rank"):
        _placement(LaunchSettings(world_size=2, dist_url="tcp://127.0.0.1:5"), None)


def test_tcp_rank_takes_the_device_of_its_place_on_the_node():
    # rank 9 of 16 on 8-device nodes: the second device of the second node, not a ninth device
    assert local_index(9, None, None, devices_per_node=8) == 1
    assert [local_index(r, None, None, 4) for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert local_index(9, "3", 5, 8) == 3  # LOCAL_RANK first (a launcher that sets it)
    assert local_index(9, None, 5, 8) == 5  # then --local-rank
    assert local_index(9, None, None, 0) == 9  # a CPU node: no devices to index


def test_tcp_placement_reads_local_rank_and_local_world_size(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    config = LaunchSettings(world_size=4, rank=3, dist_url="tcp://127.0.0.1:5")
    assert _placement(config, None) == (3, 4, 1, 2, "tcp://127.0.0.1:5")


def test_incomplete_launcher_environments(monkeypatch):
    with pytest.raises(UserError, match="MASTER_ADDR"):
        _placement(LaunchSettings(world_size=2, rank=0), None)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(UserError, match="RANK"):
        _placement(LaunchSettings(), None)


def test_devices():
    assert _device(LaunchSettings(no_accel=True), 3) == torch.device("cpu")
    assert _device(LaunchSettings(device="cpu"), 0) == torch.device("cpu")
    if not torch.cuda.is_available():
        assert _device(LaunchSettings(), 0) == torch.device("cpu")
        with pytest.raises(UserError, match="--device cuda"):
            _device(LaunchSettings(device="cuda"), 0)


def test_backend_follows_the_device():
    cpu = torch.device("cpu")
    assert _backend(LaunchSettings(), cpu) == "gloo"
    with pytest.raises(UserError, match="nccl"):
        _backend(LaunchSettings(dist_backend="nccl"), cpu)


def test_gpu_pin_is_refused_with_several_local_ranks(monkeypatch):
    for name, value in dict(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="2").items():
        monkeypatch.setenv(name, value)
    with pytest.raises(UserError, match="--gpu 0 would put all 2 processes"):
        init_distributed(LaunchSettings(gpu=0), workers=4)


def test_a_process_started_on_its_own_may_pin_its_device(monkeypatch):
    """The classic example's one process per invocation, each with its own --gpu: only the
    device itself can refuse it (on a machine without one, here)."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    config = LaunchSettings(gpu=1, world_size=2, rank=1, dist_url=f"tcp://127.0.0.1:{free_port()}")
    monkeypatch.setattr(env, "_tcp_store", lambda *args: None)  # no rank 0 to meet
    with pytest.raises(UserError, match="--gpu 1: no accelerator"):
        init_distributed(config, workers=4)


def test_a_gpu_pin_without_an_accelerator_is_refused():
    if torch.accelerator.current_accelerator(check_available=True) is None:
        with pytest.raises(UserError, match="--gpu 0: no accelerator is available here"):
            _device(LaunchSettings(gpu=0), 0)


@pytest.mark.parametrize(
    "launcher",
    [
        dict(RANK="1", WORLD_SIZE="2", LOCAL_RANK="1"),  # torchrun
        dict(SLURM_PROCID="1", SLURM_LOCALID="1", SLURM_STEP_NUM_TASKS="2"),  # srun
    ],
)
def test_a_launched_process_given_a_tcp_url_is_refused_not_trained_alone(monkeypatch, launcher):
    for name, value in launcher.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(UserError, match="drop --dist-url"):
        _placement(LaunchSettings(dist_url="tcp://127.0.0.1:5"), None)
    both = LaunchSettings(dist_url="tcp://127.0.0.1:5", world_size=2, rank=1)  # said in full: kept
    assert _placement(both, None)[:2] == (1, 2)


def test_srun_tasks_meet_on_the_first_host_of_the_nodelist(monkeypatch):
    srun = dict(
        SLURM_PROCID="5",
        SLURM_LOCALID="1",
        SLURM_STEP_NUM_TASKS="8",
        SLURM_STEP_TASKS_PER_NODE="4(x2)",
        SLURM_STEP_NODELIST="gpu[07-08]",
        SLURM_JOB_ID="4242",
    )
    for name, value in srun.items():
        monkeypatch.setenv(name, value)
    assert _placement(LaunchSettings(), None) == (5, 8, 1, 4, "tcp://gpu07:16242")
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert _placement(LaunchSettings(), None)[4] == "tcp://10.0.0.1:29500"
    monkeypatch.setenv("WORLD_SIZE", "8")  # srun running torchrun: torchrun's variables win
    monkeypatch.setenv("RANK", "2")
    assert _placement(LaunchSettings(), None)[:2] == (2, 8)


def test_the_meeting_counts_the_ranks_on_this_host():
    # Two --dist-url tcp:// ranks here and one elsewhere: this rank's threads are a share of
    # the cores between 2, the number no launcher told it.
    store = dist.TCPStore("127.0.0.1", free_port(), 3, is_master=True, wait_for_workers=False)
    for host in (socket.gethostname(), "elsewhere"):  # the other ranks arrived first
        store.add(f"{env._HOSTS}/{host}", 1)
        store.add(env._ARRIVED, 1)
    assert env._meet(store, 0, 3, datetime.timedelta(seconds=10)) == 2


def test_restarts_across_nodes_are_warned_of_on_rank_0_only(monkeypatch, capsys):
    torchrun = dict(
        TORCHELASTIC_USE_AGENT_STORE="True", GROUP_WORLD_SIZE="2", TORCHELASTIC_MAX_RESTARTS="3"
    )
    for name, value in torchrun.items():
        monkeypatch.setenv(name, value)
    timeout = datetime.timedelta(seconds=1)
    said = []
    assert env._restart_safe_store("env://", timeout, 0, said.append) is None
    assert said == [
        "warning: torchrun --max-restarts across nodes can hang on restart unless torchrun "
        "runs with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (see the README)"
    ]
    assert env._restart_safe_store("env://", timeout, 1, said.append) is None
    assert env._restart_safe_store("env://", timeout, 0, None) is None  # nowhere to say it
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "0")
    assert env._restart_safe_store("env://", timeout, 0, said.append) is None
    assert len(said) == 1 and capsys.readouterr() == ("", "")


def test_multiprocessing_distributed_reads_nodes_as_the_classic_example_does(monkeypatch):
    """Under env://, WORLD_SIZE and RANK are the node count and this node's rank, when
    --world-size and --rank do not say them (a scheduler that exports them for each node)."""
    assert launch._nodes(LaunchSettings()) == (1, 0)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert launch._nodes(LaunchSettings()) == (2, 1)
    assert launch._nodes(LaunchSettings(world_size=3, rank=2)) == (3, 2)  # the flags win
    # a URL of its own: flags only
    assert launch._nodes(LaunchSettings(dist_url="tcp://h:5")) == (1, 0)
    monkeypatch.delenv("RANK")
    with pytest.raises(UserError, match="needs --rank"):
        launch._nodes(LaunchSettings())


def test_a_free_port_is_drawn_above_the_ephemeral_range_whatever_the_seed():
    # Ports in the range go to other processes' outgoing connections as well; seeded draws
    # would give two runs with the same --seed the same port.
    end, drawn = ports._ephemeral_end(), set()
    if end >= 65535:
        pytest.skip("the ephemeral range ends at 65535 here: free_port takes the kernel's pick")
    state = random.getstate()  # the seed must not reach the tests after this one
    try:
        for _ in range(5):
            random.seed(0)
            port = free_port()
            with socket.socket() as s:
                s.bind(("127.0.0.1", port))  # free
            drawn.add(port)
    finally:
        random.setstate(state)
    assert all(end < p <= 65535 for p in drawn) and len(drawn) > 1
