"""How a run's math executes: autocast dtype, gradient scaling, memory format, compilation.

bf16 autocast runs on CPUs (avx512_bf16, AMX) and GPUs; fp16 needs CUDA and a GradScaler. The
default, auto, takes bf16 where the device has bf16 units and fp32 elsewhere. channels_last is
on by default for convolutional models: the layout their fast kernels want.

channels_last lays out the batches, and so every activation, in NHWC; `place` lays out the
parameters too. Under fsdp on several ranks the parameters stay contiguous (FSDP2 shards
contiguous parameters; sharding places them, not `place`): a convolution takes its layout from
its input, so NHWC batches alone get the NHWC kernels (measured in docs/strategies.md).
"""

import contextlib
import dataclasses
import functools
import platform
from dataclasses import dataclass

import torch
from torch import nn

from ddptrain.config import Config, ModelSettings
from ddptrain.data.transforms import MEAN, STD, normalization
from ddptrain.errors import UserError

DTYPES = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Precision:
    device_type: str = "cpu"
    amp: str = "none"
    channels_last: bool = False
    compile: bool = False
    scaler: torch.amp.GradScaler | None = None
    reason: str = ""  # why this amp, for the start-up summary
    warning: str | None = None  # rank 0 shows it: a choice that works but is slow here
    mean: tuple[float, ...] = MEAN  # the normalisation of uint8 batches (--mean, --std)
    std: tuple[float, ...] = STD

    def autocast(self) -> contextlib.AbstractContextManager:
        dtype = DTYPES[self.amp]
        return torch.autocast(self.device_type, dtype=dtype, enabled=dtype is not None)

    def inputs(self, images: torch.Tensor, device: torch.device) -> torch.Tensor:
        """A loader batch on the device, in the run's layout. uint8 images cross to the device
        as they are (a quarter of float32's bytes) and become normalised float32 there; float
        batches are taken as already normalised."""
        layout = torch.channels_last if self.channels_last else torch.contiguous_format
        images = images.to(device, non_blocking=True)
        if images.dtype == torch.uint8:
            # (x / 255 - mean) / std in the loader's NCHW layout, where the per-channel constants
            # make long contiguous runs: on a CPU, faster than in channels_last.
            scale, shift = _normalization(images.device, tuple(self.mean), tuple(self.std))
            images = images.float()
            images = torch.addcmul(shift, images, scale, out=images)
        return images.contiguous(memory_format=layout)

    def place(self, model: nn.Module, device: torch.device) -> nn.Module:
        layout = torch.channels_last if self.channels_last else torch.preserve_format
        return model.to(device, memory_format=layout)

    def backward(self, loss: torch.Tensor) -> None:
        """fp16: the loss scaled up, so that small gradients do not underflow."""
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """fp16: the gradients at their true size (before clipping them)."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """fp16: the gradients unscaled first; a step with inf/nan gradients is skipped and the
        scale lowered."""
        if self.scaler is None:
            optimizer.step()
        else:
            self.scaler.step(optimizer)
            self.scaler.update()

    def amp_choice(self) -> str:
        """The amp and, when auto chose it, why: for the start-up summary."""
        return f"{self.amp} ({self.reason})" if self.reason else self.amp

    def settings(self) -> dict:
        return {"amp": self.amp, "channels_last": self.channels_last, "compile": self.compile}


@functools.cache
def _normalization(
    device: torch.device, mean: tuple[float, ...], std: tuple[float, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel scale and shift on the device, made once: a fresh host tensor in every step
    would be a host-to-device copy per step."""
    m = torch.tensor(mean, dtype=torch.float64).view(1, 3, 1, 1)
    s = torch.tensor(std, dtype=torch.float64).view(1, 3, 1, 1)
    scale, shift = 1 / (255 * s), -m / s
    return scale.float().to(device), shift.float().to(device)


def _convolutional(model: nn.Module) -> bool:
    return any(isinstance(m, nn.Conv2d) for m in model.modules())


def bf16_units(device: torch.device) -> bool:
    """Whether the device computes bf16 in hardware (else bf16 is emulated: slower than fp32)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported(including_emulation=False)
    if device.type == "cpu":
        return cpu_bf16_units(
            platform.machine(),
            # torch's own CPU feature checks (private, but what its kernels dispatch on)
            torch.cpu._is_avx512_bf16_supported(),
            torch.cpu._is_amx_tile_supported(),
            bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()),
        )
    return device.type == "xpu"  # Intel GPUs: bf16 in every generation torch supports


def cpu_bf16_units(machine: str, avx512_bf16: bool, amx: bool, onednn_bf16: bool) -> bool:
    """Whether a CPU computes bf16 in hardware. On x86 that takes avx512_bf16 or AMX: oneDNN
    also says it supports bf16 on plain AVX-512, where it emulates it, several times slower
    than fp32 (docs/performance.md). On Arm, oneDNN's answer is the bf16 extension."""
    if machine.lower() in ("x86_64", "amd64", "i386", "i686"):
        return avx512_bf16 or amx
    return onednn_bf16


def auto_amp(
    device_type: str,
    has_bf16_units: bool,
    bitwise: bool = False,
    strided_single_pixel: str | None = None,
) -> tuple[str, str]:
    """--amp auto: (the amp, the reason the start-up shows). bf16 where the device has bf16
    units: there it is the fastest math that needs no loss scaling. fp16 is never chosen: it
    needs a GradScaler (a host sync per step) and can overflow.

    bitwise: --seed promises bitwise-repeatable runs, which oneDNN's bf16 kernels do not give
    (two identical resnet18 backward passes differ, even on one thread), so a seeded CPU run
    stays in fp32. CUDA's deterministic algorithms cover bf16.
    strided_single_pixel: a convolution of the model that oneDNN's bf16 backward gets wrong at
    this crop size (see strided_single_pixel), so the CPU run stays in fp32."""
    if device_type == "cpu" and has_bf16_units and bitwise:
        return "none", "auto: --seed asks for bitwise-repeatable runs, which bf16 on a CPU is not"
    if device_type == "cpu" and has_bf16_units and strided_single_pixel:
        return "none", f"auto: {_WRONG_IN_BF16.format(strided_single_pixel)}"
    if device_type in ("cuda", "cpu", "xpu") and has_bf16_units:
        return "bf16", f"auto: the {device_type} device has bf16 units"
    if device_type in ("cuda", "cpu", "xpu"):
        return "none", f"auto: the {device_type} device has no bf16 units (bf16 would be emulated)"
    return "none", f"auto: bf16 autocast is not chosen on {device_type}"


# torch 2.14.1's oneDNN: the bf16 backward of a strided convolution of a 1x1 map leaves part of
# its weight gradient uninitialised, non-finite at random (a 3x3 stride-2 convolution from 256
# to 512 channels; not at stride 1 or on a 2x2 map: docs/performance.md).
_WRONG_IN_BF16 = (
    "{} convolves a 1x1 map with a stride at this crop size, where bf16 on a CPU gives "
    "non-finite gradients now and then"
)


def strided_single_pixel(model: nn.Module, image_size: int) -> str | None:
    """The first convolution with a stride > 1 that a 1x1 map reaches at image_size crops (in
    resnet18 at 16 px, layer4.0.conv1), or None. A forward of the model over meta copies of
    its tensors: shapes only, no memory or compute, and the same answer on every rank, whether
    its model holds weights or was built on the meta device."""
    names = {m: n for n, m in model.named_modules() if isinstance(m, nn.Conv2d)}
    found: list[str] = []

    def note(conv: nn.Conv2d, args) -> None:
        if max(conv.stride) > 1 and tuple(args[0].shape[-2:]) == (1, 1):
            found.append(names[conv])

    hooks = [conv.register_forward_pre_hook(note) for conv in names]
    tensors = {
        name: torch.empty_like(t, device="meta")
        for name, t in [*model.named_parameters(), *model.named_buffers()]
    }
    images = torch.empty(2, 3, image_size, image_size, device="meta")
    try:
        with torch.no_grad():
            torch.func.functional_call(model, tensors, (images,))
    except Exception:  # a model a meta pass cannot take: nothing known against bf16
        return None
    finally:
        for hook in hooks:
            hook.remove()
    return found[0] if found else None


def resolve_precision(
    config: ModelSettings,
    saved_config: dict | None,
    model: nn.Module,
    device: torch.device,
    *,
    image_size: int,
    seeded: bool,
) -> Precision:
    """The run's precision: the flags given, else a resumed checkpoint's, else the defaults.
    image_size: the train crop (--image-size); seeded: --seed is given."""
    saved = saved_config or {}
    amp = config.amp or saved.get("amp") or "auto"
    reason, wrong = "", None
    if amp in ("auto", "bf16") and device.type == "cpu":
        wrong = strided_single_pixel(model, image_size)
    if amp == "auto":
        amp, reason = auto_amp(device.type, bf16_units(device), seeded, wrong)
    channels_last = config.channels_last
    if channels_last is None:
        channels_last = saved.get("channels_last", _convolutional(model))
    compiled = config.compile if config.compile is not None else saved.get("compile", False)
    if amp == "fp16" and device.type != "cuda":
        raise UserError(f"--amp fp16 needs CUDA (this run is on {device.type}); use --amp bf16")
    warning = None
    if amp == "bf16" and device.type == "cpu" and not bf16_units(device):
        warning = "--amp bf16: this CPU has no bf16 units; bf16 is emulated and slower than fp32"
    elif amp == "bf16" and wrong:
        warning = f"--amp bf16: {_WRONG_IN_BF16.format(wrong)}; --amp none avoids it"
    scaler = torch.amp.GradScaler("cuda") if amp == "fp16" else None
    return Precision(device.type, amp, bool(channels_last), bool(compiled), scaler, reason, warning)


def run_precision(config: Config, model: nn.Module, device: torch.device) -> Precision:
    """resolve_precision for a run's Config (no checkpoint's settings left to merge)."""
    seeded = config.optim.seed is not None
    precision = resolve_precision(
        config.model, None, model, device, image_size=config.data.image_size, seeded=seeded
    )
    mean, std = normalization(config.data)
    return dataclasses.replace(precision, mean=mean, std=std)
