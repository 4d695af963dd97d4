"""FSDP2: which modules of a model become their own shard group, and the wrapping.

Each block of the network is a unit: its parameters are gathered just before its forward and
freed after (but the last block's, which backward needs first: see `shard`), so a rank holds the
whole of one block at a time and a shard of the rest. The rule:

1. the blocks the models are built from (model/providers.py: ResNet's BasicBlock and
   Bottleneck, ViT's EncoderBlock, ConvNeXt's CNBlock, Swin, MobileNet, ShuffleNet, MNASNet, RegNet,
   EfficientNet, MaxViT and DenseNet blocks; timm's of the same families), outermost first (a
   block inside a block is not a unit of its own);
2. a model with none of them: each child of its `features` and `classifier` stacks that holds
   parameters (VGG, AlexNet, SqueezeNet);
3. else each direct child of the model that holds parameters (GoogLeNet, Inception v3).

Then the root, which takes what no unit holds (stem, head). Under --amp, the BatchNorms of
each unit and of the root are one more group, kept in fp32 (see `shard`).

The whole model never sits on the device. Only rank 0 builds real weights (the other ranks
build on the meta device, which holds no memory, and then make room for their shards alone);
on rank 0 one unit at a time passes through the device whole as it is sharded. Rank 0's
weights are then scattered into every rank's shards one tensor at a time.
"""

import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import distribute_tensor

from ddptrain.distributed.collectives import broadcast_buffers
from ddptrain.distributed.env import DistEnv
from ddptrain.errors import UserError
from ddptrain.model import providers


def _holds_parameters(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def _outermost_blocks(model: nn.Module) -> list[nn.Module]:
    units: list[nn.Module] = []
    blocks = providers.blocks()

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if isinstance(child, blocks):
                units.append(child)
            else:
                visit(child)

    visit(model)
    return units


def shard_units(model: nn.Module) -> list[nn.Module]:
    """The modules that get their own fully_shard, in forward order (see the module's rule)."""
    units = _outermost_blocks(model)
    if not units:
        stacks = [getattr(model, name, None) for name in ("features", "classifier")]
        stacks = [s for s in stacks if isinstance(s, nn.Sequential)] or [model]
        units = [child for stack in stacks for child in stack.children()]
    return [unit for unit in units if _holds_parameters(unit)]


def _batch_norms(modules) -> list[nn.Module]:
    return [
        m
        for m in modules
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and _holds_parameters(m)
    ]


def mixed_precision(amp_dtype: torch.dtype | None) -> MixedPrecisionPolicy:
    """Parameters gathered and computed in the autocast dtype; gradients reduced in fp32, so the
    sum over ranks loses nothing to the low precision."""
    if amp_dtype is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=amp_dtype, reduce_dtype=torch.float32)


def offload_policy(offload: bool, device: torch.device) -> OffloadPolicy:
    """Parameters, gradients and optimizer state on the host between uses. Pinned host memory
    needs a CUDA driver: without one, pinning fails, so it is asked for only on CUDA runs."""
    if not offload:
        return OffloadPolicy()
    return CPUOffloadPolicy(pin_memory=device.type == "cuda")


def shard(
    model: nn.Module,
    arch: str,
    amp_dtype: torch.dtype | None = None,
    offload: bool = False,
    reshard_after_forward: bool = True,
    device: torch.device | None = None,
) -> nn.Module:
    """fully_shard on each unit, then the root, over the default process group's ranks, on
    `device` (each unit's parameters move there as it is sharded, or to host memory under
    `offload`; meta ones stay meta). Under `amp_dtype`, the BatchNorms of each unit and of the
    root are a group of their own, in fp32."""
    units = shard_units(model)
    if not units:
        raise UserError(f"--strategy fsdp: no blocks to shard in --arch {arch}; use --strategy ddp")
    device = device or torch.device("cpu")
    options = dict(
        # The run's device, not FSDP's default (the machine's accelerator): `--device cpu` on a
        # GPU machine shards on the CPU.
        mesh=init_device_mesh(device.type, (dist.get_world_size(),)),
        mp_policy=mixed_precision(amp_dtype),
        offload_policy=offload_policy(offload, device),
    )
    # Under --amp, BatchNorm keeps its parameters in fp32, as under ddp's autocast: gathered in
    # the autocast dtype they differ in dtype from its fp32 running statistics, which batch norm
    # refuses (CUDA's in backward, the CPU's in forward for resnet50). So each unit's norms (and
    # the root's) are a group of their own, gathered in fp32 and kept gathered from forward to
    # backward: they are small, and it saves one all-gather per group in backward.
    in_units = {id(m) for unit in units for m in unit.modules()}
    outside = [m for m in model.modules() if id(m) not in in_units]
    fp32 = {**options, "mp_policy": MixedPrecisionPolicy()}
    for unit, inside in [*((unit, unit.modules()) for unit in units), (model, outside)]:
        norms = _batch_norms(inside) if amp_dtype is not None else []
        if norms:
            fully_shard(norms, reshard_after_forward=False, **fp32)
        if norms != [unit]:  # else the unit is itself a BatchNorm (vgg*_bn's, under rule 2)
            # Two groups stay gathered after forward, each saving one all-gather per step: the
            # root (stem, head), used last in backward, and the last unit, used first: backward
            # would gather it again right away, with little or no compute to overlap.
            reshard = reshard_after_forward and unit not in (model, units[-1])
            fully_shard(unit, reshard_after_forward=reshard, **options)
    return model


def shard_from_rank0(
    model: nn.Module,
    env: DistEnv,
    arch: str,
    amp_dtype: torch.dtype | None = None,
    offload: bool = False,
    reshard_after_forward: bool = True,
) -> nn.Module:
    """The model sharded over the ranks (`shard`), every shard holding rank 0's weights and
    every rank rank 0's buffers, as DDP starts every rank from rank 0's. `model` is built on the
    CPU on rank 0 and on the CPU or the meta device on the others. A collective."""
    # Rank 0's full copy stays in host memory, as the device receives only its shards: detached
    # aliases of the storage as built, which fully_shard's move (`param.data = ...`) leaves.
    initial = {name: p.detach() for name, p in model.named_parameters()} if env.is_main else {}
    model = shard(model, arch, amp_dtype, offload, reshard_after_forward, env.device)
    if any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
        _make_room(model, env.device, offload)
    _scatter_from_rank0(model, initial, env)
    broadcast_buffers(model, env)  # non-persistent ones too: a meta rank holds them unset
    return model


def meta_copy(model: nn.Module) -> nn.Module:
    """model's structure, copied on the meta device: its tensors are never copied (deepcopy
    finds a meta twin of each in its memo), so a rank holding the whole model holds it once."""
    memo: dict = {}
    for tensor in (*model.parameters(), *model.buffers()):
        empty = torch.empty_like(tensor, device="meta")
        if isinstance(tensor, nn.Parameter):
            empty = nn.Parameter(empty, requires_grad=tensor.requires_grad)
        memo[id(tensor)] = empty
    return copy.deepcopy(model, memo)


def shard_twin(
    structure: nn.Module,
    env: DistEnv,
    arch: str,
    amp_dtype: torch.dtype | None = None,
    offload: bool = False,
) -> nn.Module:
    """A twin of the sharded model for the EMA: `structure` (a meta_copy of the model before
    sharding) sharded as shard_from_rank0 shards the model, with room for its shards and
    buffers but no values: the caller copies the model's in, shard by shard. No collective."""
    twin = shard(structure, arch, amp_dtype, offload, device=env.device)
    _make_room(twin, env.device, offload)
    return twin


def _make_room(model: nn.Module, device: torch.device, offload: bool) -> None:
    """Memory for a meta rank's shards and buffers where FSDP keeps them on rank 0: shards on
    the device, or in host memory under --fsdp-offload (buffers stay on the device)."""
    model.to_empty(device=torch.device("cpu") if offload else device)
    if offload:
        for module in model.modules():
            for name, buffer in module.named_buffers(recurse=False):
                setattr(module, name, buffer.to(device))


def _scatter_from_rank0(model: nn.Module, initial: dict[str, torch.Tensor], env: DistEnv) -> None:
    """Each rank's shard of every parameter, scattered from rank 0's full tensors one at a time
    on the device. Not torch's set_model_state_dict(broadcast_from_rank0): it refuses a model
    whose tensors are on two devices, as under --fsdp-offload (shards on the host, buffers on
    the GPU)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if env.is_main:
                full = initial[name].to(env.device)
            else:  # the shape alone counts: rank 0's data is scattered into it
                full = torch.empty(param.shape, dtype=param.dtype, device=env.device)
            mine = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=0)
            param.to_local().copy_(mine.to_local())
