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

# These take their published weights with ImageNet's input transform built in.
_TRANSFORM_INPUT = ("googlenet", "inception_v3")


class Torchvision:
    """torchvision.models, by name (`resnet50`, `vit_b_16`, ...)."""

    library = "torchvision"

    @functools.cached_property
    def names(self) -> tuple[str, ...]:
        """The classification models it builds (not helpers such as `get_model`)."""
        import torchvision

        return tuple(torchvision.models.list_models(module=torchvision.models))

    def build(
        self, name: str, num_classes: int, image_size: int, published: bool, meta: bool
    ) -> nn.Module:
        """The model with a num_classes head, its structure ready for `published` weights or
        for training from scratch on image_size crops; on the meta device if asked and the
        model can be built there."""
        import torchvision

        options: dict = {"num_classes": num_classes}
        if published and name in _TRANSFORM_INPUT:
            options["transform_input"] = True
        if name.startswith("vit_") and not published:
            # A ViT's position embedding is sized for its image size (224 unless told): build it
            # for the crops it will see. Published weights are for 224 px only.
            options["image_size"] = image_size
        if meta:
            try:
                with torch.device("meta"):
                    return torchvision.models.get_model(name, **options)
            except (NotImplementedError, RuntimeError):
                pass  # RegNet reads its widths out of tensors: built with weights, as on rank 0
        return torchvision.models.get_model(name, **options)

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


TORCHVISION = Torchvision()
PROVIDERS = (TORCHVISION,)


def provider(arch: str) -> Torchvision:
    """The provider that builds --arch."""
    return TORCHVISION


def blocks() -> tuple[type[nn.Module], ...]:
    """Every provider's blocks: fsdp's units, whichever model it is given."""
    return tuple(block for p in PROVIDERS for block in p.blocks)
