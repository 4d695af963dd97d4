"""The one place that decides how the model is spread over the ranks: ddp or fsdp.

ddp keeps a whole copy of the model, its gradients and optimizer state on every rank and
all-reduces gradients; fsdp (FSDP2) shards all three and gathers each block just in time (see
parallel/fsdp.py). One rank runs the plain model under either: there is nothing to shard.
"""

import contextlib
import os
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

from ddptrain.config import ParallelSettings
from ddptrain.distributed.env import DistEnv
from ddptrain.errors import UserError
from ddptrain.parallel import comm_hooks, fsdp

STRATEGIES = ("ddp", "fsdp")
ONE_BUCKET_MB = 1 << 20  # a bucket cap no model reaches
SHARDED_RECOMPILE_LIMIT = 64  # compiled variants of one function under fsdp: see compile_model


def wrap(
    model: nn.Module,
    env: DistEnv,
    gpu_pinned: bool = False,
    strategy: str = "ddp",
    arch: str = "",
    amp_dtype: torch.dtype | None = None,
    offload: bool = False,
    reshard_after_forward: bool = True,
    comm: ParallelSettings | None = None,
    example: torch.Tensor | None = None,
    place: Callable[[nn.Module], nn.Module] | None = None,
) -> nn.Module:
    """The model placed on env.device by `place` (device, memory format; by default the device
    alone) and wrapped for `strategy`. Build the optimizer on what this returns: under fsdp its
    parameters are the shards.

    ddp: DDP with two or more ranks, on CPU as well as GPU; DataParallel as the classic example
    does for one process on several GPUs. A collective with two or more ranks. `example`, a
    batch of two inputs as training feeds them, lays DDP's buckets out before the first step
    (`lay_out_buckets`).

    fsdp with two or more ranks: sharded first, so that only shards stay on the device (host
    memory under `offload`), from rank 0's weights; the model may be built on the meta device on
    the other ranks (`builds_on_meta`). Sharding places each unit, so `place` is not called: the
    parameters keep their contiguous layout, which FSDP2 shards (channels_last lays out the
    batches alone, see precision).
    """
    assert strategy in STRATEGIES, strategy
    if will_shard(env, strategy):
        return fsdp.shard_from_rank0(model, env, arch, amp_dtype, offload, reshard_after_forward)
    model = place(model) if place is not None else model.to(env.device)
    if env.distributed:
        device_ids = None if env.device.type == "cpu" else [env.device.index]
        return _ddp(model, device_ids, comm or ParallelSettings(), example, amp_dtype)
    if env.device.type == "cuda" and not gpu_pinned and torch.cuda.device_count() > 1:
        warnings.warn(
            "one process on several GPUs: using DataParallel, which is slower than DDP; "
            "launch with `torchrun --nproc-per-node N -m ddptrain train ...` instead",
            stacklevel=2,
        )
        return nn.DataParallel(model if amp_dtype is None else ReplicaAutocast(model, amp_dtype))
    return model


class ReplicaAutocast(nn.Module):
    """The model under DataParallel with --amp: torch's parallel_apply enters autocast anew in
    each replica's thread without the run's dtype, which on CUDA is fp16 (--amp bf16 would run
    fp16 with no loss scaling). Each replica's forward enters the run's own."""

    def __init__(self, module: nn.Module, dtype: torch.dtype):
        super().__init__()
        self.module, self.dtype = module, dtype

    def forward(self, *args, **kwargs):
        with torch.autocast("cuda", dtype=self.dtype):
            return self.module(*args, **kwargs)


def will_shard(env: DistEnv, strategy: str) -> bool:
    """Whether `wrap` shards the model: fsdp on two or more ranks (one process trains it plain)."""
    return env.distributed and strategy == "fsdp"


def builds_on_meta(env: DistEnv, strategy: str) -> bool:
    """Whether this rank builds its model without weights, on the meta device: under fsdp on
    two or more ranks, every rank but rank 0, whose weights `wrap` scatters into the shards.
    A rank then never holds the whole model, in host memory or on the device."""
    return will_shard(env, strategy) and not env.is_main


def rewrapped(
    model: nn.Module,
    comm: ParallelSettings,
    example: torch.Tensor | None,
    amp_dtype: torch.dtype | None,
) -> nn.Module:
    """The wrapped model after some of its parameters began to require gradients
    (--unfreeze-epoch): DDP's reducer covers only those that required them when it was built,
    so DDP is built anew, laid out as `wrap` lays it (a resumed run's wrap builds the same). A
    collective under DDP. fsdp and one process take the change as it comes."""
    compiled = hasattr(model, "_orig_mod")
    ddp = getattr(model, "_orig_mod", model)
    if not isinstance(ddp, DistributedDataParallel):
        return model
    # The old reducer's hooks would go on reducing into its buckets in every backward.
    ddp._remove_autograd_hooks()
    ddp.module.zero_grad(set_to_none=True)  # views into the old reducer's buckets
    fresh = _ddp(ddp.module, ddp.device_ids, comm, example, amp_dtype)
    return compile_model(fresh) if compiled else fresh


def _ddp(
    model: nn.Module,
    device_ids,
    comm: ParallelSettings,
    example: torch.Tensor | None,
    amp_dtype: torch.dtype | None,
) -> DistributedDataParallel:
    ddp = DistributedDataParallel(
        model,
        device_ids=device_ids,
        # Gradients as views into the all-reduce buckets: one copy less per step.
        gradient_as_bucket_view=True,
        bucket_cap_mb=_bucket_cap_mb(comm),
        static_graph=comm.static_graph,
    )
    if example is not None:
        lay_out_buckets(ddp, example, amp_dtype)  # before a hook sees any bucket
    state = comm_hooks.register(
        ddp, comm.ddp_comm_hook, comm.powersgd_rank, comm.powersgd_start_step
    )
    if state is not None:
        ddp.powersgd_state = state  # for checkpoint_parts
    return ddp


def lay_out_buckets(
    ddp: DistributedDataParallel, example: torch.Tensor, amp_dtype: torch.dtype | None
) -> None:
    """DDP's buckets laid out in the order backward makes the gradients, before training: one
    backward of `example`, then the re-layout DDP would otherwise do as the next forward starts.

    DDP starts with the parameters in one bucket and re-lays its buckets as the forward after a
    process's first backward starts: a run resumed at step N would reduce step N in the first
    layout where the uninterrupted run used the second. With three ranks or more the all-reduce
    adds each element's terms in an order the layout decides (gloo's ring splits the buffer into
    chunks by offset), so the resumed run would drift from the uninterrupted one (2 ranks add
    a + b, the same either way; docs/faults.md). Done here, the re-layout (old and new
    buckets held at once) also comes before the optimizer holds any state, a resumed one's
    included. A collective. The weights and buffers (BatchNorm's statistics) are left as they
    were; the gradients are zeros in the new buckets, as they are after every later step that
    zeroes them there (train.step, accumulating): DDP averages a gradient that is its bucket in
    place and copies and scales one beside it, which differ in the last bit on 3 ranks."""
    module = ddp.module
    buffers = [buffer.clone() for buffer in module.buffers()]
    device_type = example.device.type
    with torch.autocast(device_type, dtype=amp_dtype, enabled=amp_dtype is not None):
        outputs = ddp(example)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)  # auxiliary heads
    sum(output.float().sum() for output in outputs).backward()
    module.zero_grad(set_to_none=False)  # views of the buckets, which the re-layout moves
    with torch.no_grad():
        for buffer, kept in zip(module.buffers(), buffers, strict=True):
            buffer.copy_(kept)
    # What DDP's own forward does first (private API, torch 2.14; a collective: rank 0's layout
    # is broadcast): its next forward then finds the buckets rebuilt.
    if ddp.reducer._rebuild_buckets():
        ddp._has_rebuilt_buckets = True


def _bucket_cap_mb(comm: ParallelSettings) -> float | None:
    """PowerSGD on gloo gets one bucket: each bucket's hook chains its all-reduces from
    callbacks, and with several buckets in flight the ranks issued them in different orders
    ("collective mismatch", torch 2.14)."""
    if comm.ddp_comm_hook != "powersgd" or dist.get_backend() != "gloo":
        return comm.bucket_cap_mb
    if comm.bucket_cap_mb is not None:
        raise UserError(
            "--bucket-cap-mb with --ddp-comm-hook powersgd on gloo: powersgd runs there with "
            "one bucket (several can mismatch collectives); drop --bucket-cap-mb"
        )
    return ONE_BUCKET_MB


def checkpoint_parts(model: nn.Module, env: DistEnv) -> dict:
    """The Stateful parts a checkpoint needs from the wrapper itself (PowerSGD's state)."""
    state = getattr(model, "powersgd_state", None)
    return {} if state is None else {"powersgd": comm_hooks.PowerSGDCheckpoint(state, env)}


def forget_dropped_step(model: nn.Module) -> None:
    """After a step dropped on every rank for non-finite gradients (--nonfinite skip): what the
    gradient communication kept of them (PowerSGD's error feedback) starts over."""
    state = getattr(model, "powersgd_state", None)
    if state is not None:
        state.forget()


@contextlib.contextmanager
def no_gradient_sync(model: nn.Module):
    """Backward without reducing gradients over the ranks: for all but the last micro-batch of
    an accumulated step, whose backward then reduces the sum once."""
    model = getattr(model, "_orig_mod", model)  # torch.compile wraps the DDP or FSDP module
    if isinstance(model, DistributedDataParallel):
        with model.no_sync():
            yield
    elif isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        yield


def gradients_in_buckets(model: nn.Module) -> bool:
    """Whether the model's gradients are views into DDP's buckets (gradient_as_bucket_view),
    which DDP keeps allocated for the whole run."""
    model = getattr(model, "_orig_mod", model)  # torch.compile wraps the DDP module
    return isinstance(model, DistributedDataParallel) and model.gradient_as_bucket_view


def compile_model(model: nn.Module) -> nn.Module:
    """The wrapped model under torch.compile (--compile); `unwrap` finds the module under it.

    ddp: one graph of the whole model, which DDP's optimizer splits at its buckets. fsdp:
    FSDP2's hooks run outside the graph, so each shard unit is compiled on its own, and the
    units of one class share one forward function, of which dynamo keeps a variant per shape
    (ResNet's blocks come in several widths). Left to itself, dynamo makes the widths symbolic
    at the second shape, and inductor then fails on BatchNorm's backward ("Cannot convert
    expression to float", torch 2.14 on the CPU). So under fsdp shapes stay static, and a
    function may keep 64 variants instead of dynamo's 8: resnet50 has 8 block shapes, each
    compiled for training and for evaluation, and again for a smaller last batch. Past the
    limit a unit runs eager (dynamo warns). The limit is dynamo's process-wide setting: it
    holds for anything else compiled in this process.
    """
    if not is_sharded(model):
        return torch.compile(model)
    limit = torch._dynamo.config.recompile_limit
    torch._dynamo.config.recompile_limit = max(limit, SHARDED_RECOMPILE_LIMIT)
    return torch.compile(model, dynamic=False)


def own_compile_cache(local_rank: int) -> None:
    """Each rank of a node compiles into a cache folder of its own (inductor's default folder,
    then rank<local rank>), unless TORCHINDUCTOR_CACHE_DIR names one: inductor writes a
    compiled kernel's library in place, and ranks that compiled the same kernel at once into one
    folder loaded each other's half-written files ("main.so: file too short",
    pytorch/pytorch#180841). Ranks compile at the same time anyway, so sharing saved nothing;
    each rank's folder still serves its later runs."""
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        folder = os.path.join(default_cache_dir(), f"rank{local_rank}")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = folder


def is_sharded(model: nn.Module) -> bool:
    return isinstance(unwrap(model), FSDPModule)


def reshard_gathered(model: nn.Module) -> None:
    """Frees the parameters a sharded model still holds gathered, back to this rank's shards.
    A forward without backward (an evaluation) leaves the groups that skip resharding after
    forward (fsdp.shard: the root, the last block, the BatchNorm groups under --amp) gathered
    until the next backward, which for the EMA's twin never comes. No collective; nothing to do
    on a model not sharded."""
    for module in unwrap(model).modules():
        if isinstance(module, FSDPModule):
            module.reshard()  # not recursive


def unwrap(model: nn.Module) -> nn.Module:
    """The module under DDP / DataParallel / torch.compile, whose state dict has no prefixes.
    (FSDP2 wraps in place: the module is its own unwrapped self.)"""
    while True:
        if isinstance(model, (DistributedDataParallel, nn.DataParallel, ReplicaAutocast)):
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            return model
