"""Where models come from, by --arch: today torchvision's classification models.

A provider names the models it builds, builds one for a class count and crop size (on the meta
device when asked), says where its published weights are, and names the blocks its models are
built from, which fsdp shards as units (parallel/fsdp.py). The builder (model/build.py), fsdp, the
planner and export reach models only through this, so another library's models (timm's) are a
second provider here, chosen by the form of the name.
"""

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

    def classifier(self, model: nn.Module) -> nn.Module:
        """The classification head: the last layer with weights of the model's `fc`,
        `classifier`, `heads` or `head` (the layer the class count shapes)."""
        for attribute in _HEADS:
            part = getattr(model, attribute, None)
            if isinstance(part, nn.Module):
                layers = [m for m in part.modules() if isinstance(m, (nn.Linear, nn.Conv2d))]
                if layers:
                    return layers[-1]
        raise AssertionError(f"no classifier head found in {type(model).__name__}")

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
        head = {f"{name}." for name, m in model.named_modules() if m is self.classifier(model)}
        for name in ids:
            if any(name.startswith(prefix) for prefix in head):
                ids[name] = len(starts) + 1
        return ids

    def set_grad_checkpointing(self, model: nn.Module) -> None:
        """Each block's forward through torch.utils.checkpoint: its activations are recomputed
        in backward instead of kept."""
        for _, block in _outermost(model, self.blocks):
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
        return checkpoint(run, *args, use_reentrant=False, **kwargs)

    checkpointed = type(f"Checkpointed{block.__name__}", (block,), {"forward": forward})
    return checkpointed


TORCHVISION = Torchvision()
PROVIDERS = (TORCHVISION,)


def provider(arch: str) -> Torchvision:
    """The provider that builds --arch."""
    return TORCHVISION


def blocks() -> tuple[type[nn.Module], ...]:
    """Every provider's blocks: fsdp's units, whichever model it is given."""
    return tuple(block for p in PROVIDERS for block in p.blocks)
