"""`ddptrain plan`'s flags, table, JSON and fit search, over a stand-in for the traced figures
(tests/e2e/test_plan.py runs the real trace)."""

import dataclasses
import json

import pytest

from ddptrain.cli import main, parse
from ddptrain.errors import UserError
from ddptrain.tools import plan as planner
from ddptrain.tools.plan import GiB, PlanRequest, Workload

MiB = 2**20
REQUIRED = ("params", "grads", "optimizer", "activations", "peak")


def figures(strategy: str, world_size: int, per_rank_batch: int, accum_steps: int = 1) -> dict:
    """What a trace of a model with 300 MiB of parameters and 40 MiB of activations per image
    would give: the peak grows linearly with the images of a forward pass, fsdp shards the
    model state, and accumulating holds 50 MiB of gradients more."""
    shards = world_size if strategy == "fsdp" else 1
    state = 300 * MiB // shards
    activations = 40 * MiB * (per_rank_batch // accum_steps)
    step_peak = 3 * state + activations + 10 * MiB + (50 * MiB if accum_steps > 1 else 0)
    rebuild = 4 * state if strategy == "ddp" and world_size > 1 else None
    return {
        "params": state, "grads": state, "optimizer": state, "ema": 0, "buffers": 1024,
        "inputs": per_rank_batch * 3 * 224 * 224 * 4, "activations": activations,
        "comm_buffers": 0 if strategy == "ddp" else 50 * MiB,
        "all_gather_peak": None if strategy == "ddp" else 60 * MiB,
        "bucket_rebuild": rebuild, "step_peak": step_peak, "peak": max(step_peak, rebuild or 0),
        "at_step_peak": {},
    }  # fmt: skip


@pytest.fixture
def traces(monkeypatch):
    """Stands in for the traced child process; records each call's per-rank batch."""
    calls = []

    def trace(workload, strategies, deadline=None):
        calls.append((tuple(strategies), workload.per_rank_batch))
        return {
            s: figures(s, workload.world_size, workload.per_rank_batch, workload.accum_steps)
            for s in strategies
        }

    monkeypatch.setattr(planner, "trace", trace)
    monkeypatch.setattr(planner, "cuda_memory", lambda: None)
    return calls


def test_global_batch_must_divide_over_the_ranks():
    with pytest.raises(UserError, match=r"--batch-size 10 .* 4 ranks; use a multiple of 4"):
        PlanRequest(arch="resnet18", world_size=4, batch_size=10)
    assert PlanRequest(arch="resnet18", world_size=4, batch_size=12).per_rank_batch == 3


def test_divide_error_is_one_line_from_the_command(capsys):
    assert main(["plan", "-a", "resnet18", "--world-size", "3", "-b", "8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ddptrain: error: --batch-size 8"), err


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--world-size", "0"], "--world-size"),
        (["--num-classes", "0"], "--num-classes"),
        (["--device-memory", "-1"], "--device-memory"),
        (["--amp", "fp8"], "--amp"),
        (["--amp", "auto"], "--amp auto"),  # a precision for a device plan may not be on
        (["--image-size", "8"], "--image-size"),
    ],
)
def test_bad_flags_name_themselves(argv, flag):
    with pytest.raises(UserError, match=flag):
        parse(["plan", "-a", "resnet18", *argv])


def test_unknown_arch_is_a_user_error():
    with pytest.raises(UserError, match="--arch"):
        parse(["plan", "-a", "resnet9000"])


def test_flags_parse_into_a_request():
    command, request = parse(
        ["plan", "-a", "vit_b_16", "--world-size", "8", "-b", "512", "--image-size", "384",
         "--amp", "bf16", "--num-classes", "10", "--device-memory", "80", "--json"]
    )  # fmt: skip
    assert command == "plan"
    assert request == PlanRequest("vit_b_16", 8, 512, 384, "bf16", 10, 80.0, True)
    assert request.per_rank_batch == 64


def test_json_is_one_object_keyed_by_strategy(traces):
    request = PlanRequest("resnet50", world_size=2, batch_size=8, device_memory=80, json=True)
    out = planner.answer(request).strip().splitlines()
    assert len(out) == 1
    result = json.loads(out[0])
    assert set(result) == {"ddp", "fsdp"}
    for strategy in ("ddp", "fsdp"):
        for key in REQUIRED:
            assert isinstance(result[strategy][key], int) and result[strategy][key] > 0, key
        assert result[strategy]["fits"] is True
        assert result[strategy]["device_memory"] == 80 * GiB
    assert result["fsdp"]["params"] == result["ddp"]["params"] // 2
    assert traces == [(("ddp", "fsdp"), 4)]  # both fit: one trace, no batch search


def test_table_shows_every_row_and_which_strategy_fits(traces):
    # ddp peaks at 4 x 300 MiB (its bucket rebuild), fsdp at 3 x 150 + 4 x 40 + 10 MiB.
    request = PlanRequest("resnet50", world_size=2, batch_size=8, device_memory=1.0)
    text = planner.table(request, planner.plan(request))
    for label, _ in planner.ROWS:
        assert label in text
    assert "global batch 8 (4 per rank)" in text
    fits = next(line for line in text.splitlines() if line.lstrip().startswith("fits"))
    assert fits.split()[-2:] == ["no", "yes"]
    assert "Only fsdp fits 1.00 GiB: train with --strategy fsdp." in text


def test_without_a_device_the_table_says_how_to_get_a_verdict(traces):
    request = PlanRequest("resnet50", world_size=2, batch_size=8)
    text = planner.table(request, planner.plan(request))
    assert "--device-memory" in text.splitlines()[-1]
    assert not any(line.lstrip().startswith("fits") for line in text.splitlines())


def largest_fitting(strategy: str, world_size: int, usable: int) -> int:
    return max(
        (b for b in range(1, 200) if figures(strategy, world_size, b)["peak"] <= usable), default=0
    )


@pytest.mark.parametrize("device_gib", [2.0, 3.0, 5.5])
def test_neither_fitting_names_the_largest_batch_each_would_take(traces, device_gib):
    request = PlanRequest("resnet50", world_size=2, batch_size=256, device_memory=device_gib)
    result = planner.plan(request)
    usable = int(device_gib * GiB * planner.USABLE)
    for strategy in ("ddp", "fsdp"):
        expected = largest_fitting(strategy, 2, usable)
        assert result[strategy]["fits"] is False
        assert result[strategy]["fitting_batch"] == expected * 2, strategy
    searches = [c for c in traces if len(c[0]) == 1]
    assert len(searches) <= 2 * planner.BATCH_SEARCH_TRACES
    text = planner.verdict(request, result)
    assert text.startswith(f"Neither fits {device_gib:.2f} GiB at -b 256: ddp fits -b ")


def test_no_batch_fits_when_the_model_state_alone_does_not(traces):
    request = PlanRequest("resnet50", world_size=2, batch_size=8, device_memory=0.5)
    result = planner.plan(request)
    assert result["ddp"]["fitting_batch"] is None and result["fsdp"]["fitting_batch"] is None
    assert "ddp not even at 1 image per rank" in planner.verdict(request, result)


def plan_line(strategy: str, device_memory: int | None) -> str:
    workload = Workload("resnet50", 1000, 2, 4, 224, "none")
    return planner.plan_line(workload, strategy, device_memory)


def test_plan_line_without_a_device_is_the_strategy_figures(traces):
    line = plan_line("ddp", None)
    assert line.startswith("plan: ddp, 4 per rank: peak 1.17 GiB per rank")
    assert "fit" not in line and traces == [(("ddp",), 4)]


def test_plan_line_fitting(traces):
    assert plan_line("fsdp", 8 * GiB).endswith("; fits 8.00 GiB (7.20 GiB usable)")


def test_plan_line_names_the_strategy_that_would_fit(traces):
    line = plan_line("ddp", 1 * GiB)
    assert "will NOT fit 1.00 GiB (922 MiB usable): --strategy fsdp would (peak 620 MiB)" in line


def test_plan_line_names_the_batch_that_would_fit_and_the_accumulation_that_keeps_b(traces):
    line = plan_line("fsdp", int(0.6 * GiB))
    assert largest_fitting("fsdp", 2, int(0.6 * GiB * planner.USABLE)) == 2
    # 2 images per forward fit without accumulating; with it, whose gradients take 50 MiB
    # more (traced), only 1: 4 per rank in 4 forward passes, not 2.
    assert line.endswith(": -b 4 would (2 per rank), or --accum-steps 4 at -b 8"), line
    assert traces[-2:] == [(("fsdp",), 4), (("fsdp",), 4)]  # the two splits traced


def test_under_accumulation_the_search_is_over_whole_forward_passes(traces):
    workload = Workload("resnet50", 1000, 2, 8, 224, "none", accum_steps=2)
    line = planner.plan_line(workload, "fsdp", int(0.6 * GiB))
    assert line.startswith("plan: fsdp, 8 per rank (4 per forward): peak ")
    assert line.endswith(": -b 4 would (2 per rank), or --accum-steps 8 at -b 16"), line
    assert all(per_rank % 2 == 0 for _, per_rank in traces), traces


def test_plan_line_when_nothing_fits(traces):
    assert "not even at 1 image per rank" in plan_line("fsdp", 300 * MiB)
    accumulating = Workload("resnet50", 1000, 2, 8, 224, "none", accum_steps=2)
    line = planner.plan_line(accumulating, "fsdp", 300 * MiB)
    assert "not even at 1 image per forward pass (2 per rank)" in line


def test_a_candidate_that_does_not_trace_counts_as_not_fitting(traces, monkeypatch):
    stand_in = planner.trace

    def trace(workload, strategies, deadline=None):
        if workload.forward_batch == 1:  # as BatchNorm refuses one image
            raise UserError("--arch resnet50: it does not run on 224 px crops")
        return stand_in(workload, strategies, deadline)

    monkeypatch.setattr(planner, "trace", trace)
    # 4 forward passes of 1 would keep -b 8 (see above), but do not trace: the rest stands.
    assert plan_line("fsdp", int(0.6 * GiB)).endswith(": -b 4 would (2 per rank)")


def test_a_trace_is_kept_and_a_damaged_kept_file_is_traced_again(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    children = []

    def trace_in_child(request, deadline):
        children.append(request)
        return {
            s: figures(s, request["world_size"], request["per_rank_batch"])
            for s in request["strategies"]
        }

    monkeypatch.setattr(planner, "_trace_in_child", trace_in_child)
    workload = Workload("resnet50", 1000, 2, 4, 224, "none")
    first = planner.trace(workload, ("ddp",))
    assert planner.trace(workload, ("ddp",)) == first and len(children) == 1
    assert planner.trace(workload.with_batch(8), ("ddp",)) != first
    assert len(children) == 2  # another batch is another trace
    for damage, traces_so_far in (("{torn", 3), ('{"ddp": {}}', 4)):
        for kept in (tmp_path / "ddptrain" / "plans").iterdir():
            kept.write_text(damage)
        assert planner.trace(workload, ("ddp",)) == first
        assert len(children) == traces_so_far


def test_a_run_plans_with_its_own_flags(monkeypatch):
    import torch

    from ddptrain.config import Config
    from ddptrain.distributed.env import DistEnv
    from ddptrain.run import _plan

    planned = []

    def plan_line(workload, strategy, device_memory_bytes, seconds):
        planned.append((workload, strategy, device_memory_bytes))
        return "plan: traced"

    monkeypatch.setattr(planner, "plan_line", plan_line)
    env = DistEnv(0, 2, 0, 2, torch.device("cpu"))
    config = Config(
        arch="resnet18", batch_size=16, image_size=32, strategy="fsdp", opt="adamw",
        model_ema=True, accum_steps=2, reshard_after_forward=False,
    )  # fmt: skip
    assert _plan(config, env, 10, "bf16") == "plan: traced"
    workload = Workload(
        "resnet18", 10, 2, 8, 32, "bf16",
        opt="adamw", model_ema=True, accum_steps=2, reshard_after_forward=False,
    )  # fmt: skip
    assert planned == [(workload, "fsdp", None)]
    # What a trace on one device cannot place: said, not left out silently.
    offloaded = Config(arch="resnet18", batch_size=16, strategy="fsdp", fsdp_offload=True)
    assert _plan(offloaded, env, 10, "none") == (
        "plan: traced; --fsdp-offload keeps the model state in host memory, not on the device"
    )


def test_plan_takes_the_run_flags_that_change_memory():
    command, request = parse(
        ["plan", "-a", "resnet18", "--world-size", "2", "-b", "8", "--opt", "adamw",
         "--momentum", "0", "--model-ema", "--accum-steps", "2", "--no-reshard-after-forward"]
    )  # fmt: skip
    assert request.workload == Workload(
        "resnet18", 1000, 2, 4, 224, "none",
        opt="adamw", momentum=0.0, model_ema=True, accum_steps=2, reshard_after_forward=False,
    )  # fmt: skip
    assert parse(["plan", "-a", "resnet18"])[1].workload == Workload(
        "resnet18", 1000, 1, 256, 224, "none"
    )
    with pytest.raises(UserError, match="--accum-steps 3"):
        parse(["plan", "-a", "resnet18", "-b", "8", "--accum-steps", "3"])
    with pytest.raises(UserError, match="--opt"):
        parse(["plan", "-a", "resnet18", "--opt", "lamb"])


def test_a_trace_past_its_deadline_fails_in_one_line():
    import time

    request = dict(arch="resnet18", num_classes=3, world_size=1, image_size=16, per_rank_batch=2)
    request.update(amp="none", strategies=["ddp"])
    with pytest.raises(RuntimeError, match=r"^the memory trace took longer than 0 s$"):
        planner._trace_in_child(request, deadline=time.monotonic() - 1)


def test_plan_takes_a_frozen_backbone_and_checkpointing_as_train_does(traces):
    command, request = parse(
        ["plan", "-a", "resnet18", "-b", "8", "--freeze-backbone", "--grad-checkpointing"]
    )
    assert request.workload == Workload(
        "resnet18", 1000, 1, 8, 224, "none", freeze_backbone=True, grad_checkpointing=True
    )
    plain = parse(["plan", "-a", "resnet18"])[1].workload
    assert not plain.freeze_backbone and not plain.grad_checkpointing
    text = planner.table(request, planner.plan(request))
    assert "--freeze-backbone, --grad-checkpointing" in text.splitlines()[0]


@pytest.mark.parametrize(
    ("flags", "planned_frozen"),
    [
        ({}, False),
        ({"freeze_backbone": True}, True),
        # It trains the whole model from epoch 2: planned as the larger, unfrozen part.
        ({"freeze_backbone": True, "unfreeze_epoch": 2}, False),
    ],
)
def test_a_run_plans_its_backbone_frozen_only_when_it_stays_frozen(
    monkeypatch, flags, planned_frozen
):
    import torch

    from ddptrain.config import Config
    from ddptrain.distributed.env import DistEnv
    from ddptrain.run import _plan

    planned = []
    monkeypatch.setattr(planner, "plan_line", lambda workload, *_, **__: planned.append(workload))
    config = Config(arch="resnet18", batch_size=8, grad_checkpointing=True, **flags)
    _plan(config, DistEnv(0, 1, 0, 1, torch.device("cpu")), 10, "none")
    (workload,) = planned
    assert workload.freeze_backbone is planned_frozen
    assert workload.grad_checkpointing


def test_a_kept_trace_is_one_of_the_same_freezing_and_checkpointing():
    workload = Workload("resnet18", 10, 1, 4, 32, "none")
    files = {
        planner._remembered_file(dataclasses.asdict(w))
        for w in (
            workload,
            dataclasses.replace(workload, freeze_backbone=True),
            dataclasses.replace(workload, grad_checkpointing=True),
        )
    }
    assert len(files) == 3
