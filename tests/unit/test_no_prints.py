"""Only the command layer writes to the terminal: cli.py, errors.py (the one error line) and
report/ (the Reporter, and progress.say and counting for whoever has no Reporter yet). Every
other module returns values, raises, or takes say/counting from its caller, so that what rank 0
shows is decided in one place and other ranks stay quiet."""

import ast
from pathlib import Path

import ddptrain

PACKAGE = Path(ddptrain.__file__).parent
COMMAND_LAYER = ("cli.py", "errors.py", "report/")
# Modules that still write, each to move its output to its caller; an entry goes once it no
# longer writes (the last test says when).
NOT_YET: dict[str, str] = {}


def terminal_writes(source: str) -> list[tuple[int, str]]:
    """(line, what) for each use of print, each sys.stdout/sys.stderr write and tqdm import."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Name) and node.id == "print":  # a call, or print handed on
            found.append((node.lineno, "print"))
        elif (
            isinstance(node, ast.Attribute)
            and node.attr in ("write", "writelines")
            and isinstance(node.value, ast.Attribute)
            and node.value.attr in ("stdout", "stderr")
            and isinstance(node.value.value, ast.Name)
            and node.value.value.id == "sys"
        ):
            found.append((node.lineno, f"sys.{node.value.attr}.{node.attr}"))
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            names += [alias.name for alias in node.names]
            if any(name.split(".")[0] == "tqdm" for name in names):
                found.append((node.lineno, "tqdm"))
    return sorted(found)


def modules() -> dict[str, list[tuple[int, str]]]:
    """Every module below the command layer, by path in the package, with what it writes."""
    paths = sorted(PACKAGE.rglob("*.py"))
    named = {path.relative_to(PACKAGE).as_posix(): path for path in paths}
    return {
        name: terminal_writes(path.read_text())
        for name, path in named.items()
        if not name.startswith(COMMAND_LAYER)
    }


def test_no_module_below_the_command_layer_writes_to_the_terminal():
    writing = {name: found for name, found in modules().items() if found and name not in NOT_YET}
    assert writing == {}, "return the lines, or take progress.say / counting from the caller"


def test_the_scan_sees_each_way_of_writing():
    source = (
        "import sys\nfrom tqdm import tqdm\nimport tqdm.auto\n"
        "print('x')\nsys.stderr.write('x')\nsys.stdout.writelines(['x'])\nf(callback=print)\n"
        "say('x')\nsys.stderr.flush()\n"
    )
    assert terminal_writes(source) == [
        (2, "tqdm"),
        (3, "tqdm"),
        (4, "print"),
        (5, "sys.stderr.write"),
        (6, "sys.stdout.writelines"),
        (7, "print"),
    ]


def test_the_modules_not_yet_moved_still_write():
    found = modules()
    assert [name for name in NOT_YET if not found.get(name)] == [], "drop them from NOT_YET"
