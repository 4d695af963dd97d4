"""--strategy fsdp on real gloo ranks: the same training as ddp, and checkpoints that move
between the strategies and world sizes."""

import pytest
import torch
import torchvision
from harness import run_ranks
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.tensor import DTensor

from ddptrain.config import Config
from ddptrain.data.loaders import build_data
from ddptrain.data.sources import open_source
from ddptrain.model.build import build_model
from ddptrain.model.precision import Precision
from ddptrain.parallel.fsdp import shard_units
from ddptrain.parallel.parallelize import builds_on_meta, is_sharded, unwrap, wrap
from ddptrain.state.checkpointer import Checkpointer, ModelState, TrainState, training_parts
from ddptrain.state.files import load
from ddptrain.train.step import Step
from ddptrain.train.trainer import evaluate

META = {"arch": "resnet18", "num_classes": 3, "class_to_idx": {}, "config": {}}


def group_norm_resnet(env):
    """A BatchNorm-free resnet18 (GroupNorm), so ranks and strategies agree to float error; its
    BasicBlocks are fsdp's units. Other ranks start from other weights: like DDP, fsdp must
    start every rank from rank 0's."""
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=3, norm_layer=lambda c: nn.GroupNorm(4, c))
    if env.rank != 0:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    return model


def flat(state: dict) -> torch.Tensor:
    """Every tensor of a state dict as one float vector (BatchNorm's counts included)."""
    return torch.cat([v.float().flatten() for v in state.values()])


def full_weights(checkpointer: Checkpointer):
    """The model's full state as one vector on rank 0 (None elsewhere). A collective."""
    state = checkpointer.parts["model"].state_dict()
    return flat(state) if checkpointer.env.is_main else None


def timm_vit(env, arch="timm:test_vit"):
    """timm's test ViT for 16 px crops (one patch), LayerNorm only; other ranks start from other
    weights, as group_norm_resnet's."""
    torch.manual_seed(0)
    model = build_model(arch, 3, 16, False)
    if env.rank != 0:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    return model


def train_epoch(
    env,
    root,
    out_dir,
    strategy,
    resume=None,
    sharded_format=False,
    wrapping=None,
    nhwc=False,
    arch="resnet18",
):
    """One epoch (2 steps of global batch 12) from scratch or from `resume`, then a checkpoint
    (a DCP folder with sharded_format); `wrapping`: more of wrap's options; `nhwc`: the batches
    in channels_last, as --channels-last lays them out; `arch` timm:test_vit for timm's ViT
    instead of group_norm_resnet."""
    out_dir.mkdir(exist_ok=True)
    config = Config(data=str(root), batch_size=12, workers=0, image_size=16)
    loaders = build_data(config, env, open_source(config), seed=11)
    built = timm_vit(env, arch) if arch.startswith("timm:") else group_norm_resnet(env)
    model = wrap(built, env, strategy=strategy, arch=arch, **(wrapping or {}))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 30)
    parts = training_parts(unwrap(model), optimizer, scheduler, env, sharded=is_sharded(model))
    checkpointer = Checkpointer(
        env, out_dir, parts, META, {}, keep_last=5, sharded_format=sharded_format
    )
    state = TrainState() if resume is None else checkpointer.restore(load(resume))
    loaders.train_sampler.set_epoch(state.epoch)
    step = Step(model, optimizer)
    for images, target in loaders.train_loader:
        step(Precision(channels_last=nhwc).inputs(images, env.device), target)
        state.global_step += 1
    if is_sharded(model):  # NHWC batches leave the shards as FSDP2 keeps them
        assert all(p.to_local().is_contiguous() for p in model.parameters())
    state.epoch += 1
    checkpointer.save(state)
    return full_weights(checkpointer)


@pytest.fixture(scope="module")
def first_epoch(tiny_data, tmp_path_factory):
    """Epoch 1 on 2 ranks under each strategy: {strategy: (out_dir, weights)}."""
    runs = {}
    for strategy in ("ddp", "fsdp"):
        out_dir = tmp_path_factory.mktemp(strategy)
        runs[strategy] = out_dir, run_ranks(train_epoch, 2, tiny_data, out_dir, strategy)[0]
    return runs


def test_fsdp_offloaded_and_kept_gathered_after_forward_trains_the_same(
    first_epoch, tiny_data, tmp_path
):
    # --fsdp-offload (CPUOffloadPolicy) and --no-reshard-after-forward change where parameters
    # live and when they are gathered, never the math.
    options = {"offload": True, "reshard_after_forward": False}
    weights = run_ranks(train_epoch, 2, tiny_data, tmp_path, "fsdp", None, False, options)[0]
    torch.testing.assert_close(weights, first_epoch["ddp"][1], rtol=0, atol=1e-5)


def test_fsdp_on_channels_last_batches_trains_the_same(first_epoch, tiny_data, tmp_path):
    # --channels-last under fsdp: NHWC batches (so NHWC convolutions) over contiguous shards.
    weights = run_ranks(train_epoch, 2, tiny_data, tmp_path, "fsdp", None, False, None, True)[0]
    torch.testing.assert_close(weights, first_epoch["ddp"][1], rtol=0, atol=1e-5)


def test_fsdp_on_two_ranks_equals_ddp(first_epoch):
    (_, ddp), (fsdp_dir, fsdp) = first_epoch["ddp"], first_epoch["fsdp"]
    untrained = flat(group_norm_resnet(RANK0).state_dict())
    assert not torch.equal(ddp, untrained)
    torch.testing.assert_close(fsdp, ddp, rtol=0, atol=1e-5)
    saved = load(fsdp_dir / "checkpoint.pt")["model"]  # the file holds what rank 0 gathered
    torch.testing.assert_close(flat(saved), fsdp)


def test_a_timm_vit_under_fsdp_on_two_ranks_trains_as_under_ddp(tiny_data, tmp_path):
    runs = {}
    for strategy in ("ddp", "fsdp"):
        one_epoch = (train_epoch, 2, tiny_data, tmp_path / strategy, strategy)
        runs[strategy] = run_ranks(*one_epoch, None, False, None, False, "timm:test_vit")[0]
    assert not torch.equal(runs["ddp"], flat(timm_vit(RANK0).state_dict()))
    torch.testing.assert_close(runs["fsdp"], runs["ddp"], rtol=0, atol=1e-5)


def test_checkpoints_move_between_strategies_and_world_sizes(tiny_data, tmp_path, first_epoch):
    """Epoch 2 resumed under the other strategy and on other world sizes ends where ddp on 2
    ranks does (optimizer state included, or they would differ)."""
    from_ddp = first_epoch["ddp"][0] / "checkpoint.pt"
    from_fsdp = first_epoch["fsdp"][0] / "checkpoint.pt"
    reference = run_ranks(train_epoch, 2, tiny_data, tmp_path / "a", "ddp", from_ddp)[0]
    # ddp under --channels-last holds its convolution weights, so saves them, in NHWC
    channels_last = {"place": in_channels_last}
    run_ranks(train_epoch, 2, tiny_data, tmp_path / "nhwc", "ddp", None, False, channels_last)
    from_nhwc_ddp = tmp_path / "nhwc" / "checkpoint.pt"
    assert load(from_nhwc_ddp)["model"]["conv1.weight"].is_contiguous(
        memory_format=torch.channels_last
    )
    resumed = {
        "ddp checkpoint, fsdp on 2": (2, "fsdp", from_ddp),
        "channels_last ddp checkpoint, fsdp on 2": (2, "fsdp", from_nhwc_ddp),
        "fsdp checkpoint, ddp on 1": (1, "ddp", from_fsdp),
        "fsdp checkpoint, fsdp on 3": (3, "fsdp", from_fsdp),
    }
    for i, (name, (world, strategy, resume)) in enumerate(resumed.items()):
        out_dir = tmp_path / str(i)
        weights = run_ranks(train_epoch, world, tiny_data, out_dir, strategy, resume)[0]
        torch.testing.assert_close(weights, reference, rtol=0, atol=1e-5, msg=name)


def in_channels_last(model: nn.Module) -> nn.Module:
    return model.to(memory_format=torch.channels_last)


def built_and_sharded(env):
    """As `ddptrain train` builds and wraps the model under fsdp: resnet18 on rank 0, its
    structure alone on the meta device elsewhere. Returns the rank's peak bytes of tensors over
    the build and the wrap (MemTracker), its buffers, and rank 0's gathered full weights."""
    torch.manual_seed(0)
    tracker = MemTracker()
    with tracker:
        model = build_model("resnet18", 3, 16, False, meta=builds_on_meta(env, "fsdp"))
        model = wrap(model, env, strategy="fsdp", arch="resnet18")
    peaks = tracker.get_tracker_snapshot("peak").items()
    peak = sum(per_device["Total"] for device, per_device in peaks if device.type != "meta")
    buffers = flat(dict(model.named_buffers()))
    full = ModelState(model, env, sharded=True).state_dict()  # gathered on rank 0
    gathered = flat(full) if env.is_main else None
    return peak, buffers, gathered


def test_under_fsdp_no_rank_but_rank_0_ever_holds_the_whole_model():
    (peak0, buffers0, gathered), (peak1, buffers1, _) = run_ranks(built_and_sharded, 2)
    torch.manual_seed(0)
    reference = build_model("resnet18", 3, 16, False)
    sizes = [v.numel() * v.element_size() for v in reference.state_dict().values()]
    whole = sum(sizes)
    # Rank 1 never held more than its half (and padding) and the tensor being scattered into it
    # (allocated whole to receive its part), with that part.
    assert peak1 <= 0.51 * whole + 1.5 * max(sizes), (peak1, whole, max(sizes))
    assert peak1 < whole
    assert peak0 >= whole  # rank 0 built it
    # ... and holds rank 0's initial weights in its shards, and its buffers.
    expected = flat(reference.state_dict())
    torch.testing.assert_close(torch.as_tensor(gathered), expected, rtol=0, atol=0)
    torch.testing.assert_close(torch.as_tensor(buffers1), torch.as_tensor(buffers0), rtol=0, atol=0)


def test_shard_units_are_the_blocks():
    model = torchvision.models.resnet50()
    assert [type(u).__name__ for u in shard_units(model)] == ["Bottleneck"] * 16
    vgg = torchvision.models.vgg11()
    assert len(shard_units(vgg)) == 8 + 3  # the convolutions of `features`, the Linears


def test_after_forward_only_the_last_block_and_the_root_stay_gathered():
    """Backward begins with the last block and ends with the root: freed after forward, each
    would be gathered again at once. --no-reshard-after-forward keeps every block gathered.
    An evaluation, a forward with no backward to free them, leaves none gathered."""
    resharding, keeping = run_ranks(_gathered_after_forward, 2)[0]
    assert resharding == {"layer4.1": True, "root": True, "others": False, "evaluated": False}
    assert keeping == {"layer4.1": True, "root": True, "others": True, "evaluated": False}


def _gathered_after_forward(env):
    """Whether the last block's, the root's and all the other blocks' parameters are gathered
    (plain tensors, not DTensor shards) after a training forward of a 2-rank resnet18, and
    whether any is after an evaluation."""
    seen = []
    for reshard_after_forward in (True, False):
        model = build_model("resnet18", 3, 16, False, meta=builds_on_meta(env, "fsdp"))
        model = wrap(
            model,
            env,
            strategy="fsdp",
            arch="resnet18",
            reshard_after_forward=reshard_after_forward,
        )
        model(torch.randn(2, 3, 16, 16)).sum()  # no backward: as backward would find them
        gathered = {name: not isinstance(p, DTensor) for name, p in model.named_parameters()}
        blocks = [name for name in gathered if name.startswith("layer")]  # the rest: the root
        evaluate(model, [(torch.randn(2, 3, 16, 16), torch.tensor([0, 1]))], env)
        seen.append(
            {
                "layer4.1": all(gathered[n] for n in blocks if n.startswith("layer4.1.")),
                "root": gathered["conv1.weight"] and gathered["fc.weight"],
                "others": any(gathered[n] for n in blocks if not n.startswith("layer4.1.")),
                "evaluated": any(not isinstance(p, DTensor) for p in model.parameters()),
            }
        )
    return seen


RANK0 = type("Rank0", (), {"rank": 0})()


class TinyVGG(nn.Module):
    """fsdp's rule 2: the parameter-holding children of `features` and `classifier` are its
    units, so a BatchNorm is a unit of its own."""

    def __init__(self):
        super().__init__()
        conv = nn.Conv2d(3, 8, 3, padding=1)
        self.features = nn.Sequential(conv, nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1))
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(8, 3))

    def forward(self, x):
        return self.classifier(self.features(x))


def dtypes_in_a_bf16_step(env, arch):
    """The dtype each BatchNorm's and convolution's weight has as its forward runs, in two
    steps of a 2-rank fsdp model under --amp bf16; and whether the losses were finite."""
    torch.manual_seed(0)
    if arch == "tiny_vgg":
        model = TinyVGG()
    else:
        model = build_model(arch, 3, 16, False, meta=builds_on_meta(env, "fsdp"))
    model = wrap(model, env, strategy="fsdp", arch=arch, amp_dtype=torch.bfloat16)
    seen = {"norm": set(), "conv": set()}
    for module in model.modules():
        # fsdp gives a sharded module a class of its own, a subclass of the one it had
        for kind, cls in (("norm", nn.BatchNorm2d), ("conv", nn.Conv2d)):
            if isinstance(module, cls):
                module.register_forward_pre_hook(
                    lambda m, _, k=kind: seen[k].add(str(m.weight.dtype))
                )
    norms = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    before = [m.weight.full_tensor() for m in norms]
    step = Step(model, torch.optim.SGD(model.parameters(), lr=0.1), Precision(amp="bf16"))
    losses = []
    for _ in range(2):
        # 32 px, not 16: at 16 layer4's stride-2 convolution sees a 1x1 input, where torch's
        # bf16 CPU convolution (oneDNN) leaves its weight gradient partly uninitialised, NaN
        # at random (torch 2.14.1, fsdp or not).
        images, target = torch.randn(4, 3, 32, 32), torch.randint(0, 3, (4,))
        losses.append(step(images, target)[0])
    finite = bool(torch.stack(losses).isfinite().all())
    # every BatchNorm's gradient reached its shards (as the same full weights on every rank)
    changed = [
        not torch.equal(m.weight.full_tensor(), b) for m, b in zip(norms, before, strict=True)
    ]
    after = torch.cat([m.weight.full_tensor() for m in norms])
    return sorted(seen["norm"]), sorted(seen["conv"]), finite, all(changed), after


@pytest.mark.parametrize("arch", ["resnet18", "tiny_vgg"])
def test_under_fsdp_and_bf16_batch_norm_keeps_fp32_parameters(arch):
    # Gathered in bf16, BatchNorm's weights would differ in dtype from its fp32 running
    # statistics, which CUDA's batch norm refuses in backward ("Expected running_mean to have
    # type BFloat16"). As under ddp's autocast, they stay fp32; the convolutions take bf16.
    # A BatchNorm inside a unit is a group of its own; one that is a unit keeps fp32 itself.
    (*rank0, weights0), (*rank1, weights1) = run_ranks(dtypes_in_a_bf16_step, 2, arch)
    assert rank0 == rank1 == [["torch.float32"], ["torch.bfloat16"], True, True]
    torch.testing.assert_close(weights1, weights0, rtol=0, atol=0)
