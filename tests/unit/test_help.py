"""`ddptrain train --help` against a golden copy, and each flag's help from its Config field.

After changing a flag on purpose, regenerate the golden copy (with Python 3.11: argparse's
layout changes between Python versions) and review the diff:

    COLUMNS=100 python -m ddptrain train --help > tests/unit/golden/train_help.txt
"""

import subprocess
import sys
from pathlib import Path

import pytest

from ddptrain import flags_page
from ddptrain.cli import parse, train_parser
from ddptrain.config import settings

GOLDEN = Path(__file__).parent / "golden" / "train_help.txt"
FLAGS_PAGE = Path(__file__).parents[2] / "docs" / "flags.md"
GOLDEN_PYTHON = (3, 11)


def help_text(command: str, capsys, monkeypatch) -> str:
    monkeypatch.setenv("COLUMNS", "100")
    with pytest.raises(SystemExit) as done:
        parse([command, "--help"])
    assert done.value.code == 0
    return capsys.readouterr().out


@pytest.mark.skipif(
    sys.version_info[:2] != GOLDEN_PYTHON, reason="the golden copy is argparse's 3.11 layout"
)
def test_train_help_matches_the_golden_copy(capsys, monkeypatch):
    assert help_text("train", capsys, monkeypatch) == GOLDEN.read_text()


def test_eval_has_the_same_flags(capsys, monkeypatch):
    def flags(text: str) -> str:  # the usage lines are indented by the command's length
        return text[text.index("positional arguments:") :]

    train = help_text("train", capsys, monkeypatch)
    assert flags(help_text("eval", capsys, monkeypatch)) == flags(train)


def test_every_flag_is_documented_by_its_config_field():
    train = train_parser()
    actions = {a.dest: a for a in train._actions}
    for name, f in settings().items():
        action = actions[name]
        if f.metadata["help"] is None:
            assert name == "local_rank"
            continue
        assert action.help.startswith(f.metadata["help"]), name
        if name == "data":  # the positional DATA
            assert not action.option_strings
            continue
        names = f.metadata["names"] or ("--" + name.replace("_", "-"),)
        assert set(names) <= set(action.option_strings), name


@pytest.mark.parametrize(
    "argv",
    [["train", "-b", "many"], ["train", "--nproc-per-node", "2"], ["--help"], ["train", "--help"]],
)
def test_help_and_flag_mistakes_answer_before_torch_is_imported(argv):
    """A typo or --help waited 7.7 s here for torch and torchvision to import (the plan
    subcommand's parser checked --arch): they come only with work that uses them."""
    script = (
        "import sys\n"
        "from ddptrain.cli import main\n"
        "try:\n"
        f"    main({argv!r})\n"
        "except SystemExit:\n"
        "    pass\n"
        "print(sorted(m for m in ('torch', 'torchvision') if m in sys.modules))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert done.stdout.splitlines()[-1] == "[]", done.stderr


def test_the_flags_page_is_generated_from_the_code():
    """After changing a flag: python -m ddptrain.flags_page docs/flags.md"""
    assert FLAGS_PAGE.read_text() == flags_page.reference()
