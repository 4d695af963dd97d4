"""`ddptrain export CKPT --format onnx --out M.onnx`: the model as an ONNX graph, for serving
stacks that run ONNX, checked by a real runtime before it is written.

The graph is the model itself: float NCHW input normalised as M.json says (the same JSON as a
safetensors export), logits out, any batch size. torch.onnx's exporter (torch.export, then
onnxscript) writes it; onnxruntime runs it on a few inputs against torch, and the file is
written only when the largest difference is within TOLERANCE.
"""

import json
import warnings
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ddptrain.errors import UserError, first_line
from ddptrain.state import files
from ddptrain.tools.export import check_out, sidecar_path
from ddptrain.tools.inference import load_trained

SUFFIX = ".onnx"
TOLERANCE = 1e-4  # on logits, the largest absolute difference from torch's
CHECK_BATCHES = (1, 3)  # two sizes, so a graph whose batch is fixed fails the check
MISSING = (
    "export --format onnx needs onnx, onnxscript and onnxruntime: pip install 'ddptrain[onnx]'"
)


def export_onnx(checkpoint_path: Path, out: Path) -> tuple[dict, float]:
    """Writes out and its JSON sidecar, each atomically; returns the sidecar's contents and the
    largest difference between onnxruntime's logits and torch's."""
    if out.suffix != SUFFIX:
        raise UserError(f"export: --out {out} must end in {SUFFIX} with --format onnx")
    check_out(out)
    runtime = _runtime()
    trained = load_trained(checkpoint_path, what="export: CKPT")
    size = trained.description["image_size"]
    graph = to_onnx(trained.model, size, trained.description["arch"])
    try:
        difference = largest_difference(trained.model, graph, size, runtime)
    except Exception as err:  # onnxruntime's errors have no common type either
        raise UserError(
            f"export: onnxruntime cannot run the {trained.description['arch']} graph "
            f"({first_line(err)}): {out} not written"
        ) from None
    if difference > TOLERANCE:
        raise UserError(
            f"export: onnxruntime's logits differ from torch's by up to {difference:.3g}, "
            f"above {TOLERANCE:g}: {out} not written"
        )
    files.atomic_write(out, graph)
    description = trained.description
    files.atomic_write(sidecar_path(out), (json.dumps(description, indent=2) + "\n").encode())
    return description, difference


def _runtime():
    try:
        import onnx  # noqa: F401  (torch.onnx's exporter needs all three)
        import onnxruntime
        import onnxscript  # noqa: F401
    except ImportError:
        raise UserError(MISSING) from None
    return onnxruntime


def to_onnx(model: nn.Module, image_size: int, arch: str) -> bytes:
    """The model as a serialized ONNX graph with a dynamic batch axis, named input -> logits."""
    example = torch.randn(2, 3, image_size, image_size)
    batch = torch.export.Dim("batch", min=1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the exporter's advice is for its developers
            program = torch.onnx.export(
                model,
                (example,),
                dynamo=True,
                input_names=["input"],
                output_names=["logits"],
                dynamic_shapes=({0: batch},),
                verbose=False,
            )
        return program.model_proto.SerializeToString()
    except Exception as err:  # the exporter's failures have no common type
        raise UserError(f"export: {arch} does not export to ONNX ({first_line(err)})") from None


def largest_difference(model: nn.Module, graph: bytes, image_size: int, runtime) -> float:
    """The largest absolute difference of logits between onnxruntime and torch, on random
    normalised inputs of CHECK_BATCHES sizes."""
    session = runtime.InferenceSession(graph, providers=["CPUExecutionProvider"])
    generator = torch.Generator().manual_seed(0)
    largest = 0.0
    for batch in CHECK_BATCHES:
        images = torch.randn(batch, 3, image_size, image_size, generator=generator)
        with torch.no_grad():
            expected = model(images).numpy()
        (found,) = session.run(["logits"], {"input": images.numpy()})
        difference = float(np.abs(found - expected).max())
        if not np.isfinite(difference):  # max() would pass over a NaN
            return float("inf")
        largest = max(largest, difference)
    return largest
