"""Models by torchvision name, optionally from the architecture's default weights."""

import torch
import torchvision
from torch import nn

from ddptrain.distributed import DistEnv, rank0_first
from ddptrain.errors import UserError

AUX_HEADS = ("googlenet", "inception_v3")


def _pretrained_state(arch: str, show_progress: bool) -> dict[str, torch.Tensor]:
    weights = torchvision.models.get_model_weights(arch).DEFAULT
    try:
        return weights.get_state_dict(progress=show_progress, check_hash=True)
    except (OSError, RuntimeError) as err:  # URLError is an OSError; a bad hash a RuntimeError
        cache = torch.hub.get_dir() + "/checkpoints/"
        raise UserError(
            f"--pretrained: cannot get the {arch} weights from {weights.url} ({err}); "
            f"offline, put that file in {cache}"
        ) from None


def build(arch: str, num_classes: int, pretrained: bool, env: DistEnv) -> nn.Module:
    """arch with a num_classes head; with pretrained, every weight but a resized head is loaded."""
    # Auxiliary heads make the train-mode output a tuple the loss cannot take; DDP would also
    # find their parameters unused. The classic example simply crashes on these two.
    extra = {"aux_logits": False} if arch in AUX_HEADS else {}
    model = torchvision.models.get_model(arch, num_classes=num_classes, **extra)
    if not pretrained:
        return model
    state = rank0_first(env, lambda: _pretrained_state(arch, show_progress=env.is_main))
    own = model.state_dict()
    fits = {k: v for k, v in state.items() if k in own and own[k].shape == v.shape}
    model.load_state_dict(fits, strict=False)
    fresh = sorted(set(own) - set(fits) - {k for k in own if k.endswith("num_batches_tracked")})
    if env.is_main and fresh:
        print(
            f"pretrained {arch}: new head for {num_classes} classes ({', '.join(fresh)})",
            flush=True,
        )
    return model
