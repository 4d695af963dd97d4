"""Where models come from, by --arch: torchvision's classification models by name, timm's as
`timm:NAME` or `timm:NAME.TAG` (TAG: one of its published weights).

A provider names the models it builds, builds one for a class count and crop size (on the meta
device when asked), says where its published weights are, and names the blocks its models are
built from, which fsdp shards as units (parallel/fsdp.py). The builder (model/build.py), fsdp, the
planner and export reach models only through this; the form of the name picks the provider.
"""

import contextlib
import functools

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ddptrain.errors import UserError

# These take their published weights with ImageNet's input transform built in.
_TRANSFORM_INPUT = ("googlenet", "inception_v3")
# Where torchvision's models keep their classifier: the last layer with weights in it is the head.
_HEADS = ("fc", "classifier", "heads", "head")


class Torchvision:
    """torchvision.models, by name (`resnet50`, `vit_b_16`, ...)."""

    library = "torchvision"

    @functools.cached_property
    def names(self) -> tuple[str, ...]:
        """The classification models it builds (not helpers such as `get_model`)."""
        import torchvision

        return tuple(torchvision.models.list_models(module=torchvision.models))

    def build(
        self,
        name: str,
        num_classes: int,
        image_size: int,
        published: bool,
        meta: bool,
        drop_path: float = 0.0,
    ) -> nn.Module:
        """The model with a num_classes head, its structure ready for `published` weights or
        for training from scratch on image_size crops; on the meta device if asked and the
        model can be built there. drop_path above 0: its stochastic depth rate (a model
        without stochastic depth is refused)."""
        import torchvision

        options: dict = {"num_classes": num_classes}
        if drop_path > 0:
            options["stochastic_depth_prob"] = drop_path
        if published and name in _TRANSFORM_INPUT:
            options["transform_input"] = True
        if name.startswith("vit_") and not published:
            # A ViT's position embedding is sized for its image size (224 unless told): build it
            # for the crops it will see. Published weights are for 224 px only.
            options["image_size"] = image_size
        try:
            if meta:
                try:
                    with torch.device("meta"):
                        return torchvision.models.get_model(name, **options)
                except (NotImplementedError, RuntimeError):
                    pass  # RegNet reads its widths out of tensors: built with weights, as rank 0
            return torchvision.models.get_model(name, **options)
        except TypeError as err:  # the model's constructor takes no stochastic_depth_prob
            if "stochastic_depth_prob" not in str(err):
                raise
            raise UserError(
                f"--drop-path: torchvision's {name} has no stochastic depth; drop the flag, or "
                "choose a model that has it (convnext, efficientnet, swin, maxvit)"
            ) from None

    def classifier(self, model: nn.Module) -> tuple[nn.Module, ...]:
        """The classification head, as one module: the last layer with weights of the model's
        `fc`, `classifier`, `heads` or `head` (the layer the class count shapes)."""
        for attribute in _HEADS:
            part = getattr(model, attribute, None)
            layer = _last_layer(part) if isinstance(part, nn.Module) else None
            if layer is not None:
                return (layer,)
        raise AssertionError(f"no classifier head found in {type(model).__name__}")

    def classifier_names(self, model: nn.Module) -> set[str]:
        """The state dict's names of every layer the class count shapes: the head's, and the
        auxiliary heads' of googlenet and inception_v3 (the last layer of each InceptionAux),
        which training without them drops but the model still holds."""
        from torchvision.models.googlenet import InceptionAux as GoogLeNetAux
        from torchvision.models.inception import InceptionAux

        auxiliary = (GoogLeNetAux, InceptionAux)
        heads = [_last_layer(m) for m in model.modules() if isinstance(m, auxiliary)]
        return _state_names(model, (*self.classifier(model), *heads))

    def layer_ids(self, model: nn.Module) -> dict[str, int]:
        """Each parameter's layer, counted from the input: 0 the stem (what comes before the
        first block), then one per block (the units fsdp shards) in the order the model holds
        them, which for torchvision's is depth order; what lies between two blocks goes with
        the one before. The head, with what follows the last block, is the highest."""
        starts = [name for name, module in _outermost(model, self.blocks)]
        ids, layer = {}, 0
        for name, _ in model.named_parameters():
            block = next((i for i, s in enumerate(starts, 1) if name.startswith(s + ".")), None)
            if block is not None:
                layer = block
            elif layer == len(starts) and starts:
                layer = len(starts) + 1  # past the last block: the head's
            ids[name] = layer
        (classifier,) = self.classifier(model)
        head = {f"{name}." for name, m in model.named_modules() if m is classifier}
        for name in ids:
            if any(name.startswith(prefix) for prefix in head):
                ids[name] = len(starts) + 1
        return ids

    def set_grad_checkpointing(self, model: nn.Module, arch: str) -> None:
        """Each block's forward through torch.utils.checkpoint: its activations are recomputed
        in backward instead of kept. A model with no block it knows is refused (vgg, alexnet,
        squeezenet, googlenet, inception_v3), rather than left to keep every activation."""
        outermost = _outermost(model, self.blocks)
        if not outermost:
            raise UserError(
                f"--grad-checkpointing: torchvision's {arch} has no blocks to checkpoint; drop "
                "the flag, or choose a model built of blocks (resnet, convnext, vit, swin, "
                "efficientnet, mobilenet, regnet, densenet, maxvit)"
            )
        for _, block in outermost:
            block.__class__ = _checkpointed(type(block))

    def weights_url(self, name: str) -> str:
        """Where the model's default published weights are."""
        import torchvision

        return torchvision.models.get_model_weights(name).DEFAULT.url

    @functools.cached_property
    def blocks(self) -> tuple[type[nn.Module], ...]:
        """The blocks its models are built from."""
        from torchvision.models import (
            convnext,
            densenet,
            efficientnet,
            maxvit,
            mnasnet,
            mobilenetv2,
            mobilenetv3,
            regnet,
            resnet,
            shufflenetv2,
            swin_transformer,
            vision_transformer,
        )

        return (
            resnet.BasicBlock,
            resnet.Bottleneck,
            vision_transformer.EncoderBlock,
            convnext.CNBlock,
            swin_transformer.SwinTransformerBlock,  # SwinTransformerBlockV2 is a subclass
            mobilenetv2.InvertedResidual,
            mobilenetv3.InvertedResidual,
            shufflenetv2.InvertedResidual,
            mnasnet._InvertedResidual,
            regnet.ResBottleneckBlock,
            efficientnet.MBConv,
            efficientnet.FusedMBConv,
            maxvit.MaxVitBlock,
            densenet._DenseBlock,
        )


class Timm:
    """timm's models, by `timm:NAME` or `timm:NAME.TAG` (`timm:convnext_atto.d2_in1k`): the
    name as `timm.create_model` takes it, after the prefix."""

    library = "timm"
    prefix = "timm:"

    @functools.cached_property
    def names(self) -> tuple[str, ...]:
        """The models it builds, as --arch names them (without tags)."""
        import timm

        return tuple(self.prefix + name for name in timm.list_models())

    def model_name(self, arch: str) -> str:
        """The name `timm.create_model` takes: NAME or NAME.TAG."""
        return arch.removeprefix(self.prefix)

    def pretrained_cfg(self, arch: str) -> dict:
        """timm's description of the model's default (or tagged) published weights: where they
        are (`hf_hub_id`), and the preprocessing they were trained with (mean, std,
        input_size, crop_pct, interpolation)."""
        import timm

        cfg = timm.models.get_pretrained_cfg(self.model_name(arch))
        return {} if cfg is None else cfg.to_dict()

    def preprocessing(self, arch: str) -> dict:
        """The input its published weights were trained with, by flat setting key (config.py):
        image_size, interpolation, mean, std; and crop_pct, the share of the resized image
        evaluation crops."""
        cfg = self.pretrained_cfg(arch)
        out = {key: tuple(cfg[key]) for key in ("mean", "std") if len(cfg.get(key) or ()) == 3}
        if cfg.get("input_size"):
            out["image_size"] = int(cfg["input_size"][-1])
        if cfg.get("interpolation") in ("bilinear", "bicubic", "nearest"):
            out["interpolation"] = cfg["interpolation"]
        if cfg.get("crop_pct"):
            out["crop_pct"] = float(cfg["crop_pct"])
        return out

    def model_kwargs(self, arch: str, num_classes: int, image_size: int) -> dict:
        """What `timm.create_model(NAME, **kwargs)` takes to build this run's model: the class
        count, and the image size for models whose structure depends on it (timm marks them
        `fixed_input_size`: ViTs, whose position embedding has one entry per patch)."""
        kwargs: dict = {"num_classes": num_classes}
        if self.pretrained_cfg(arch).get("fixed_input_size"):
            kwargs["img_size"] = image_size
        return kwargs

    def build(
        self,
        name: str,
        num_classes: int,
        image_size: int,
        published: bool,
        meta: bool,
        drop_path: float = 0.0,
    ) -> nn.Module:
        """The model with a num_classes head for image_size crops, initialised as timm does
        (published weights come in later: model/build.py); on the meta device if asked."""
        import timm

        kwargs = self.model_kwargs(name, num_classes, image_size)
        if drop_path > 0:
            kwargs["drop_path_rate"] = drop_path
        try:
            with torch.device("meta") if meta else contextlib.nullcontext():
                return timm.create_model(self.model_name(name), **kwargs)
        except TypeError as err:
            if "drop_path_rate" in str(err):
                raise UserError(
                    f"--drop-path: --arch {name} has no stochastic depth; leave --drop-path out"
                ) from None
            raise

    def published_state(self, arch: str, num_classes: int, image_size: int) -> dict:
        """The model's default (or tagged) published weights, for this run's model: from the
        Hugging Face cache (model/hub.py), adapted by timm's own loading (a ViT's position
        embedding resampled to image_size); without the head where the class count differs,
        which stays new."""
        import timm

        from ddptrain.model import hub

        cfg = self.pretrained_cfg(arch)
        filename = cfg.get("hf_hub_filename") or hub.WEIGHTS_FILE
        if not cfg.get("hf_hub_id") or not filename.endswith(".safetensors"):
            raise UserError(
                f"--pretrained: timm publishes no safetensors weights for {arch} on the Hugging "
                f"Face Hub; pick a tag of timm.list_pretrained('{self.model_name(arch)}*')"
            )
        path = hub.weights_file(cfg["hf_hub_id"], filename)
        loaded = timm.create_model(
            self.model_name(arch),
            pretrained=True,
            pretrained_cfg_overlay={"file": str(path), "source": None},
            **self.model_kwargs(arch, num_classes, image_size),
        )
        state = loaded.state_dict()
        if num_classes != cfg.get("num_classes"):  # timm's new head: random, not published
            heads = cfg.get("classifier") or ()
            for head in (heads,) if isinstance(heads, str) else heads:
                state.pop(f"{head}.weight", None)
                state.pop(f"{head}.bias", None)
        return state

    @functools.cached_property
    def blocks(self) -> tuple[type[nn.Module], ...]:
        """The residual blocks of timm's main families, as torchvision's: ResNet and RegNet,
        ConvNeXt (V2 too), ViT (DeiT, BEiT's layout), EVA, Swin, MaxViT and CoAtNet, the
        EfficientNet and MobileNet family (V3, V4), ByobNet's (RepVGG, MobileOne, ...)."""
        from timm.models import (
            _efficientnet_blocks,
            byobnet,
            convnext,
            eva,
            maxxvit,
            regnet,
            resnet,
            swin_transformer,
            vision_transformer,
        )

        return (
            resnet.BasicBlock,
            resnet.Bottleneck,
            regnet.Bottleneck,
            regnet.PreBottleneck,
            convnext.ConvNeXtBlock,
            vision_transformer.Block,
            vision_transformer.ResPostBlock,
            vision_transformer.ParallelScalingBlock,
            vision_transformer.ParallelThingsBlock,
            eva.EvaBlock,
            eva.EvaBlockPostNorm,
            swin_transformer.SwinTransformerBlock,
            maxxvit.MaxxVitBlock,
            maxxvit.ParallelMaxxVitBlock,
            maxxvit.MbConvBlock,
            maxxvit.ConvNeXtBlock,
            maxxvit.TransformerBlock2d,
            _efficientnet_blocks.DepthwiseSeparableConv,
            _efficientnet_blocks.InvertedResidual,  # CondConvResidual is a subclass
            _efficientnet_blocks.EdgeResidual,
            _efficientnet_blocks.UniversalInvertedResidual,
            _efficientnet_blocks.MobileAttention,
            byobnet.BasicBlock,
            byobnet.BottleneckBlock,
            byobnet.DarkBlock,
            byobnet.EdgeBlock,
            byobnet.RepVggBlock,
            byobnet.MobileOneBlock,
            byobnet.SelfAttnBlock,
        )

    def classifier(self, model: nn.Module) -> tuple[nn.Module, ...]:
        """The classification head, as its modules: what timm itself resets for a new class
        count. A distilled model (deit_*_distilled, levit_*, efficientformer_*) has two, the
        class token's and the distillation token's, which timm gives as a tuple."""
        heads = model.get_classifier()
        return heads if isinstance(heads, tuple) else (heads,)

    def classifier_names(self, model: nn.Module) -> set[str]:
        """The state dict's names of every layer the class count shapes: the head's (both of
        a distilled model). timm builds no auxiliary heads unless asked (aux_logits)."""
        return _state_names(model, self.classifier(model))

    def layer_ids(self, model: nn.Module) -> dict[str, int]:
        """Parameter name -> layer index (0: the stem, highest: the head), as timm's
        `param_groups_layer_decay` assigns them: by the model's group_matcher, else timm's
        automatic grouping, and the highest index for a parameter the map leaves out."""
        from timm.models import group_parameters
        from timm.optim._param_groups import auto_group_layers

        if hasattr(model, "group_matcher"):
            layer_map = group_parameters(model, model.group_matcher(coarse=False), reverse=True)
        else:
            layer_map = auto_group_layers(model)
        highest = max(layer_map.values())
        return {name: layer_map.get(name, highest) for name, _ in model.named_parameters()}

    def set_grad_checkpointing(self, model: nn.Module, arch: str) -> None:
        """timm's own switch: its blocks' forwards recompute activations in backward. Where
        the blocks hold BatchNorm, they are checkpointed as torchvision's are instead: timm's
        switch takes no recompute context, so the recompute would update BatchNorm's running
        statistics a second time each step."""
        outermost = _outermost(model, self.blocks)
        if any(_norms(block) for _, block in outermost):
            for _, block in outermost:
                block.__class__ = _checkpointed(type(block))
            return
        try:
            model.set_grad_checkpointing(True)
        except AssertionError:  # how timm's models without it refuse (inception_v3, vgg, ...)
            raise UserError(
                f"--grad-checkpointing: {arch} does not support gradient checkpointing in timm; "
                "drop the flag, or choose a model that does (vit, convnext, resnet, efficientnet)"
            ) from None


def _last_layer(part: nn.Module) -> nn.Module | None:
    """The last layer with weights in part: a head's classifier (a Linear, or squeezenet's
    1x1 Conv2d)."""
    layers = [m for m in part.modules() if isinstance(m, (nn.Linear, nn.Conv2d))]
    return layers[-1] if layers else None


def _state_names(model: nn.Module, layers: tuple[nn.Module, ...]) -> set[str]:
    """The state dict's names of the tensors of `layers`, modules of model."""
    return {
        f"{name}.{key}"
        for name, module in model.named_modules()
        if any(module is layer for layer in layers)
        for key in module.state_dict()
    }


def _outermost(model: nn.Module, blocks: tuple[type[nn.Module], ...]) -> list:
    """(name, module) of the blocks of model that lie in no other block, in the model's order."""
    found: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        inside = any(name.startswith(outer + ".") for outer, _ in found)
        if isinstance(module, blocks) and not inside:
            found.append((name, module))
    return found


@functools.cache
def _checkpointed(block: type[nn.Module]) -> type[nn.Module]:
    """A subclass of `block` whose training forward runs under torch.utils.checkpoint.

    A subclass, not a wrapping module (torch's checkpoint_wrapper): a wrapper adds a prefix to
    every parameter's name, which checkpoints, the layer map and pretrained files would see; a
    patched forward on the instance would be lost to copies (the EMA's twin)."""

    def forward(self, *args, **kwargs):
        if not (self.training and torch.is_grad_enabled()):
            return super(checkpointed, self).forward(*args, **kwargs)
        run = super(checkpointed, self).forward
        kept = functools.partial(_statistics_kept, self)
        return checkpoint(run, *args, use_reentrant=False, context_fn=kept, **kwargs)

    checkpointed = type(f"Checkpointed{block.__name__}", (block,), {"forward": forward})
    return checkpointed


def _statistics_kept(block: nn.Module) -> tuple:
    """torch.utils.checkpoint's contexts for the forward and the recompute of `block`: the
    recompute runs the block's BatchNorm layers in training mode again, which would update
    their running statistics a second time each step; they are put back as the forward left
    them."""
    return contextlib.nullcontext(), _buffers_put_back(_norms(block))


def _norms(block: nn.Module) -> list[nn.Module]:
    """The BatchNorm layers in block."""
    return [m for m in block.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


@contextlib.contextmanager
def _buffers_put_back(modules: list[nn.Module]):
    """The modules' buffers as they were on entering, once the block inside is done."""
    kept = [(b, b.clone()) for m in modules for b in m.buffers(recurse=False)]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in kept:
                buffer.copy_(value)


TORCHVISION = Torchvision()
TIMM = Timm()
PROVIDERS = (TORCHVISION, TIMM)


def provider(arch: str) -> Torchvision | Timm:
    """The provider that builds --arch: timm's for `timm:NAME`, else torchvision's."""
    return TIMM if arch.startswith(Timm.prefix) else TORCHVISION


def blocks() -> tuple[type[nn.Module], ...]:
    """Every provider's blocks: fsdp's units, whichever model it is given."""
    return tuple(block for p in PROVIDERS for block in p.blocks)
