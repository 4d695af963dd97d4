"""No file ddptrain opens is unpickled with code allowed: checked in the source, and on the
running call paths (ddptrain's and its dependencies') of training, resuming, evaluating and
pretrained weights."""

import ast
import pickle
from pathlib import Path

import pytest
import torch
import torchvision

from ddptrain import cli

# Defined before the fixture below replaces pickle.Unpickler: its subclass in sharded.py, which
# builds nothing but DCP's metadata classes (test_sharded_files.py), must stay the real one.
from ddptrain.state import sharded  # noqa: F401

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted([*(ROOT / "src" / "ddptrain").rglob("*.py"), *(ROOT / "bench").rglob("*.py")])


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return node.id if isinstance(node, ast.Name) else "?"


def _unsafe_calls(tree: ast.AST) -> list[str]:
    found = []
    for node in ast.walk(tree):
        weights_only = isinstance(node, ast.keyword) and node.arg == "weights_only"
        if weights_only and not (isinstance(node.value, ast.Constant) and node.value.value is True):
            found.append(f"line {node.value.lineno}: weights_only other than True")
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func)
        keywords = {k.arg: k.value for k in node.keywords}
        unsafe = (
            (name == "torch.load" and "weights_only" not in keywords)
            # torch hub's loaders and torchvision's Weights.get_state_dict unpickle with code
            # allowed by default (the DCP get_state_dict is imported by name: not a loader).
            or name.endswith(("load_state_dict_from_url", "hub.load", ".get_state_dict"))
            or (name.startswith(("pickle.", "dill.", "cloudpickle.")) and name not in HARMLESS)
            or name.endswith(("add_safe_globals", "safe_globals"))
            or (name.endswith("np.load") and "allow_pickle" in keywords)
        )
        if unsafe:
            found.append(f"line {node.lineno}: {name}")
    return found + _unrestricted_unpicklers(tree)


# Raised, never loading anything.
HARMLESS = {"pickle.UnpicklingError"}


def _unrestricted_unpicklers(tree: ast.AST) -> list[str]:
    """A subclass of pickle.Unpickler is safe only with its own find_class (the allowlist of
    what it may build): state/sharded.py reads DCP's metadata so."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.ClassDef):
            continue
        unpickler = any(_dotted(base).endswith("Unpickler") for base in node.bases)
        methods = {n.name for n in node.body if isinstance(n, ast.FunctionDef)}
        if unpickler and "find_class" not in methods:
            found.append(f"line {node.lineno}: {node.name} unpickles without find_class")
    return found


def test_the_source_loads_nothing_unsafely():
    offences = {
        str(path.relative_to(ROOT)): calls
        for path in SOURCES
        if (calls := _unsafe_calls(ast.parse(path.read_text())))
    }
    assert not offences, offences


def test_the_scan_finds_unsafe_loads():
    source = """
torch.load(path)
torch.load(path, weights_only=False)
weights.get_state_dict(progress=True)
torch.hub.load_state_dict_from_url(url)
pickle.loads(data)
class Everything(pickle.Unpickler):
    pass
"""
    assert len(_unsafe_calls(ast.parse(source))) == 6


class _NoUnpickler:
    def __init__(self, *args, **kwargs):
        raise AssertionError("a file was unpickled with code allowed")


@pytest.fixture
def unpickling_forbidden(monkeypatch):
    """Every load with code allowed fails: torch.load without weights_only=True, and the pickle
    module's own loaders (which torch.load and torch.hub reach through `pickle_module`)."""
    real_load = torch.load

    def checked_load(*args, weights_only=None, **kwargs):
        assert weights_only is True, "torch.load without weights_only=True"
        return real_load(*args, weights_only=True, **kwargs)

    monkeypatch.setattr(torch, "load", checked_load)
    for name in ("load", "loads"):
        monkeypatch.setattr(pickle, name, _NoUnpickler)
    monkeypatch.setattr(pickle, "Unpickler", _NoUnpickler)


def _train(*args) -> int:
    return cli.main([*map(str, args)])


def test_train_resume_and_eval_unpickle_nothing_unsafely(tiny_data, tmp_path, unpickling_forbidden):
    common = (tiny_data, "--image-size", "16", "-b", "8", "-j", "0", "--seed", "0")
    assert _train("train", *common, "--epochs", "1", "--out-dir", tmp_path) == 0
    resume = (*common, "--epochs", "2", "--out-dir", tmp_path, "--resume", "auto")
    assert _train("train", *resume) == 0
    evaluate = ("--resume", tmp_path / "checkpoint.pt", "--out-dir", tmp_path / "eval")
    assert _train("eval", *common, *evaluate) == 0


def test_pretrained_weights_unpickle_nothing_unsafely(
    tiny_data, tmp_path, monkeypatch, unpickling_forbidden
):
    # Published weights cannot be downloaded here: stand in a file of the right shape under the
    # published name, and let the hash check accept it.
    url = torchvision.models.get_model_weights("resnet18").DEFAULT.url
    cached = Path(torch.hub.get_dir()) / "checkpoints" / Path(url).name
    cached.parent.mkdir(parents=True, exist_ok=True)
    torch.save(torchvision.models.resnet18().state_dict(), cached)
    prefix = torch.hub.HASH_REGEX.search(cached.name)[1]
    monkeypatch.setattr("ddptrain.model.build._sha256", lambda path: prefix + "0" * 56)
    try:
        # Trained, not evaluated: 1000-class weights evaluated on 3 classes are refused.
        args = ("train", tiny_data, "--image-size", "16", "-b", "8", "-j", "0", "--pretrained")
        args = (*args, "--epochs", "1", "--out-dir", tmp_path)
        assert _train(*args) == 0
    finally:
        cached.unlink()


def test_sharded_checkpoints_unpickle_nothing_unsafely(tiny_data, tmp_path, unpickling_forbidden):
    # DCP's own reader unpickles .metadata with pickle.load and its non-tensor items with
    # torch.load(weights_only=False): both fail here, so the run takes ddptrain's readers.
    common = (tiny_data, "--image-size", "16", "-b", "8", "-j", "0", "--seed", "0")
    in_folders = ("--checkpoint-format", "sharded", "--out-dir", tmp_path)
    assert _train("train", *common, "--epochs", "1", *in_folders) == 0
    assert _train("train", *common, "--epochs", "2", *in_folders, "--resume", "auto") == 0
    evaluate = ("--resume", tmp_path / "checkpoint.dcp", "--out-dir", tmp_path / "eval")
    assert _train("eval", *common, *evaluate) == 0
    assert _train("convert", tmp_path / "checkpoint.dcp", tmp_path / "one.pt") == 0
