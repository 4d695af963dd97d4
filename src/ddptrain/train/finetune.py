"""Fine-tuning controls: the LR scale of each parameter (--layer-decay, --head-lr-scale) and the
frozen backbone (--freeze-backbone, --unfreeze-epoch). The model's provider says which layer
each parameter is in and which module is the head; the rest is the same for every library."""

from torch import nn

from ddptrain.config import OptimSettings
from ddptrain.model.providers import Timm, Torchvision


def head_names(model: nn.Module, heads: tuple[nn.Module, ...]) -> set[str]:
    """The names of the parameters of `heads`, modules of `model`, as model names them."""
    names = set()
    for prefix, module in model.named_modules():
        if any(module is head for head in heads):
            names |= {f"{prefix}.{name}" for name, _ in module.named_parameters()}
    return names


def lr_layers(
    layer_ids: dict[str, int],
    head: set[str],
    layer_decay: float | None,
    head_lr_scale: float = 1.0,
) -> dict[str, tuple[str, float]] | None:
    """Each parameter's LR group and scale: by layer_ids (name -> layer, 0 the input side),
    decay ** (top layer - its layer) as timm's param_groups_layer_decay computes it, and the
    head's parameters (`head`) a group of their own at head_lr_scale times the top layer's.
    None when every scale is 1: one LR for all, as without these flags."""
    if layer_decay is None and head_lr_scale == 1.0:
        return None
    top = max(layer_ids.values())
    layers = {}
    for name, layer in layer_ids.items():
        if name in head:
            layers[name] = ("head", head_lr_scale)  # the top layer, whose decay scale is 1
        elif layer_decay is None:
            layers[name] = ("body", 1.0)
        else:
            layers[name] = (f"layer_{layer}", layer_decay ** (top - layer))
    return layers


class Freezing:
    """--freeze-backbone: every parameter but the head's frozen (no gradient, so the optimizer
    neither moves it nor keeps state for it) and the backbone's BatchNorm layers in eval mode,
    as timm's `freeze` leaves them, so their statistics stay those of the pretrained weights.
    With --unfreeze-epoch N, only for epochs before N.

    Parameters are found by name at each change: fsdp replaces them with its shards."""

    def __init__(self, model: nn.Module, heads: tuple[nn.Module, ...], until: int | None):
        self.model, self.until = model, until
        self.head = head_names(model, heads)
        self.norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
        self.frozen = False

    def frozen_in(self, epoch: int) -> bool:
        return self.until is None or epoch < self.until

    def enter(self, epoch: int) -> bool:
        """Freezes or unfreezes the backbone for `epoch`; whether that changed anything (the
        wrapper must then learn of it: parallelize.rewrapped)."""
        frozen = self.frozen_in(epoch)
        if frozen == self.frozen:
            return False
        for name, parameter in self.model.named_parameters():
            if name not in self.head:
                parameter.requires_grad_(not frozen)
        self.frozen = frozen
        return True

    def train(self, model: nn.Module) -> None:
        """model (the wrapped one) in training mode, a frozen backbone's norms in eval mode."""
        model.train()
        if self.frozen:
            for norm in self.norms:
                norm.eval()


def fine_tuning(
    optim: OptimSettings, source: Torchvision | Timm, model: nn.Module, epoch: int
) -> tuple[dict[str, tuple[str, float]] | None, Freezing | None]:
    """The LR group of each parameter (--layer-decay, --head-lr-scale) and the backbone's
    freezing (--freeze-backbone), entered for `epoch`, from what the model's provider says of
    it. (None, None) without these flags, which leave the model's layers and head unasked."""
    if optim.layer_decay is None and optim.head_lr_scale == 1.0 and not optim.freeze_backbone:
        return None, None
    heads = source.classifier(model)
    layers = lr_layers(
        source.layer_ids(model), head_names(model, heads), optim.layer_decay, optim.head_lr_scale
    )
    freezing = None
    if optim.freeze_backbone:
        freezing = Freezing(model, heads, optim.unfreeze_epoch)
        freezing.enter(epoch)
    return layers, freezing
