import onnxruntime
import pytest
import torch
from torchvision.models import VisionTransformer

from ddptrain.errors import UserError
from ddptrain.tools.onnx_export import TOLERANCE, export_onnx, largest_difference, to_onnx


def test_a_vit_exports_with_a_dynamic_batch_and_torchs_logits():
    # torchvision's ViT, in a configuration small enough for a unit test: 32 px, 8 px patches
    torch.manual_seed(0)
    vit = VisionTransformer(
        image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64,
        num_classes=3,
    ).eval()  # fmt: skip
    graph = to_onnx(vit, 32, "vit")
    # batches of 1 and 3, where the graph was traced on 2
    assert largest_difference(vit, graph, 32, onnxruntime) <= TOLERANCE


def test_a_graph_with_other_logits_is_caught():
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 4 * 4, 2)).eval()
    graph = to_onnx(model, 4, "linear")
    with torch.no_grad():
        model[1].bias += 1e-3  # torch's model moves; the graph keeps the old bias
    assert largest_difference(model, graph, 4, onnxruntime) == pytest.approx(1e-3, rel=1e-3)


def test_the_out_path_is_checked_first(tmp_path):
    with pytest.raises(UserError, match=r"--out .*m.pt must end in .onnx"):
        export_onnx(tmp_path / "c.pt", tmp_path / "m.pt")
    with pytest.raises(UserError, match=r"no directory"):
        export_onnx(tmp_path / "c.pt", tmp_path / "missing" / "m.onnx")
    with pytest.raises(UserError, match=r"export: CKPT .*c.pt does not exist"):
        export_onnx(tmp_path / "c.pt", tmp_path / "m.onnx")
