import multiprocessing
import os

import pytest

from ddptrain.data import synth
from ddptrain.data.synth import SynthSpec
from ddptrain.errors import UserError

SMALL = SynthSpec(classes=10, train_per_class=2, val_per_class=1, size=20, seed=5)


def files(root):
    return {p.relative_to(root): p.read_bytes() for p in sorted(root.rglob("*.png"))}


def test_imagefolder_layout_and_determinism(tmp_path):
    a = synth.write(SMALL, tmp_path / "a")
    b = synth.write(SMALL, tmp_path / "b")
    assert files(a) == files(b)
    assert len(list((a / "train").iterdir())) == 10 and len(list((a / "val").iterdir())) == 10
    assert len(files(a)) == 10 * 3
    other = synth.write(
        SynthSpec(classes=10, train_per_class=2, val_per_class=1, size=20, seed=6), tmp_path / "c"
    )
    assert files(other) != files(a)


def test_refuses_to_overwrite(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    with pytest.raises(UserError, match="already exists"):
        synth.write(SMALL, tmp_path / "out")
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"


def test_bad_spec():
    with pytest.raises(UserError, match="--classes"):
        SynthSpec(classes=1)


def _ensure(cache, queue):
    os.environ["XDG_CACHE_HOME"] = cache
    original = synth.write

    def counted(*args, **kwargs):
        with open(os.path.join(cache, "writes.log"), "a") as f:
            f.write(f"{os.getpid()}\n")
        return original(*args, **kwargs)

    synth.write = counted
    queue.put(str(synth.ensure_builtin(SMALL, log=False)))


def test_concurrent_first_use_generates_once(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_ensure, args=(str(tmp_path), queue)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0
    roots = {queue.get(timeout=5) for _ in procs}
    assert len(roots) == 1
    assert len((tmp_path / "writes.log").read_text().splitlines()) == 1  # one wrote, two waited
    root = roots.pop()
    assert len(files(__import__("pathlib").Path(root))) == 30
    leftovers = [p.name for p in (tmp_path / "ddptrain").iterdir() if ".tmp-" in p.name]
    assert leftovers == []


def test_unwritable_cache_is_a_user_error(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    with pytest.raises(UserError, match="XDG_CACHE_HOME"):
        synth.ensure_builtin(SMALL, log=False)


def test_write_says_each_class_through_the_caller_and_prints_nothing_itself(tmp_path, capsys):
    said = []
    spec = SynthSpec(classes=2, train_per_class=1, val_per_class=1, size=16)
    synth.write(spec, tmp_path / "a", say=said.append)
    assert said == ["synth: class 1/2 (arrow) written", "synth: class 2/2 (bar) written"]
    synth.write(spec, tmp_path / "b")
    assert capsys.readouterr() == ("", "")


def test_ensure_builtin_says_on_stderr_that_it_generates_only_when_it_does(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    said = []
    root = synth.ensure_builtin(SMALL, log=lambda line, stderr=False: said.append((line, stderr)))
    assert said == [(f"generating the built-in dataset ({SMALL.describe()}) into {root}", True)]
    synth.ensure_builtin(SMALL, log=lambda line, stderr=False: said.append((line, stderr)))
    assert len(said) == 1  # found in the cache: nothing to say
