"""docs/flags.md: the flags of `ddptrain train`, by group, as `--help` gives them.

Generated from the parser cli.py builds from the Config fields, so the page cannot drift from
the code (tests/unit/test_help.py fails when it is stale); it sits above cli.py, which it
reads. Regenerate with:

    python -m ddptrain.flags_page docs/flags.md
"""

import argparse
import sys
from pathlib import Path

from ddptrain.cli import train_parser

HEADER = """\
# Flags of `ddptrain train`

Generated from the code by `python -m ddptrain.flags_page docs/flags.md`; `ddptrain train
--help` says the same. `ddptrain eval` takes the same flags. A config file (`--config FILE`) takes
the long names without the dashes as keys (`batch-size = 256`); flags given on the command line
win over it, and it wins over a resumed checkpoint's settings (docs/config.md).
"""


_ARGPARSE_GROUPS = ("positional arguments", "options")


def reference() -> str:
    train = train_parser()
    groups: dict[str, list[argparse.Action]] = {}
    for group in train._action_groups:
        # argparse's own two groups hold DATA and --config
        title = "DATA and --config" if group.title in _ARGPARSE_GROUPS else group.title
        groups.setdefault(title, []).extend(
            a for a in group._group_actions if a.help != argparse.SUPPRESS and a.dest != "help"
        )
    lines = [HEADER]
    for title, actions in groups.items():
        heading = title if title.startswith("ddptrain") else title[0].upper() + title[1:]
        lines += [f"## {heading}", "", "| flag | meaning |", "|---|---|"]
        lines += [f"| {_cell(_spelling(a))} | {_cell(a.help)} |" for a in actions]
        lines.append("")
    return "\n".join(lines)


def _spelling(action: argparse.Action) -> str:
    names = ", ".join(action.option_strings) or action.metavar or action.dest
    metavar = action.metavar
    if action.option_strings and action.nargs != 0 and metavar is None:
        metavar = action.dest.upper()
    if isinstance(metavar, tuple):
        metavar = " ".join(metavar)
    if action.option_strings and action.nargs == "?":
        metavar = f"[{metavar}]"
    elif not action.option_strings or action.nargs == 0:
        metavar = None
    return f"`{names} {metavar}`" if metavar else f"`{names}`"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


if __name__ == "__main__":
    Path(sys.argv[1]).write_text(reference())
