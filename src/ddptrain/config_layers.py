"""The precedence chain of a run's settings, and the config files that feed it:

    defaults < checkpoint config (on resume) < --config FILE < command-line flags

Each layer holds only what it sets, keyed by flat keys (config.py): argparse leaves out the
flags not given (cli.py), `read` turns a TOML file, a shipped recipe or a saved config.json into
such a dict, and `resumed` puts a checkpoint's settings under what the user gave. `merge` is the
one place where layers meet; it returns the Config and, beside it, its `Layers`: what the file
and the flags gave, which is no setting (never in config.json or a checkpoint).

The type checks are written out here: a handful of scalar kinds and tuples of them, where a
validation library would be a dependency whose messages name Python types instead of the key
and the file.
"""

import functools
import importlib.resources
import json
import re
import tomllib
import types
import typing
from dataclasses import dataclass, fields
from pathlib import Path

from ddptrain.config import SECTIONS, Config, flag_name, flat_key, settings
from ddptrain.errors import UserError

RECIPE = "recipe:"


@dataclass(frozen=True)
class Layers:
    """What the layers above the defaults gave, by flat key, beside the Config they made.
    given: set by a --config file or a flag, which a resumed checkpoint's settings must not
    replace (`resumed`); on_command_line: set by a flag, which the run names where it acts on
    nothing (config.inert_flags). Layers() is a Config made in code: nothing given."""

    given: frozenset[str] = frozenset()
    on_command_line: frozenset[str] = frozenset()


class Unsettled(Config):
    """The settings of a run that resumes a checkpoint, before the checkpoint's settings come in
    under them (`merge` without `saved`): each setting is checked, but not how they combine,
    which the checkpoint's may still complete (`--fsdp-offload` resuming an fsdp run,
    `--val-resize` evaluating a 16 px one). `resumed` or `settled` makes the checked Config;
    `replace` keeps it unsettled."""

    checks_combinations = False


def settled(config: Config) -> Config:
    """config once no checkpoint's settings are still to come in (they are in, or there are
    none): the checks that waited for them run now."""
    if config.checks_combinations:
        return config
    return Config(**config.to_dict())


def check_batch_divides_early(config: Config, layers: Layers, world_size: int) -> None:
    """Config.check_batch_divides before anything slow (--verify-images decodes every image),
    when no checkpoint can bring its own -b or --accum-steps: those are checked once merged."""
    resume = config.checkpoint.resume
    if resume is None or {"batch_size", "accum_steps"} <= layers.given:
        config.check_batch_divides(world_size)


@functools.cache
def kinds() -> dict[str, tuple[type, int | str | None, bool]]:
    """Each setting's (scalar type, argparse nargs: None, N or "+", whether None is allowed)."""
    out = {}
    hints = {}
    for section in SECTIONS.values():
        own = typing.get_type_hints(section)
        hints.update({flat_key(f): own[f.name] for f in fields(section)})
    for key in settings():
        hint = hints[key]
        args = typing.get_args(hint)
        optional = isinstance(hint, types.UnionType) and type(None) in args
        if set(args) == {bool, str}:  # --pretrained: the flag alone, or a path
            out[key] = ((bool, str), "?", False)
            continue
        if optional:
            hint = next(a for a in args if a is not type(None))
        nargs = None
        if typing.get_origin(hint) is tuple:
            items = typing.get_args(hint)
            nargs = "+" if items[-1] is Ellipsis else len(items)
            hint = items[0]
        out[key] = (hint, nargs, optional)
    return out


_TYPE_NAMES = {
    bool: "true or false",
    int: "an integer",
    float: "a number",
    str: "a string",
    (bool, str): "true, false or a path",
}


def coerce(name: str, value, where: str, key: str | None = None):
    """value as setting `name` takes it (lists become tuples, integers become floats where a
    float is wanted), or a UserError naming the key as written (`key`) and where it came from."""
    scalar, nargs, optional = kinds()[name]
    if value is None and optional:
        return None
    wanted = _TYPE_NAMES[scalar]
    if nargs == "?":  # a value or a path: taken as it is
        ok, converted = isinstance(value, scalar), value
    elif nargs is None:
        ok = _fits(scalar, value)
        converted = scalar(value) if ok else None
    else:
        count = "one or more" if nargs == "+" else str(nargs)
        wanted = f"a list of {count} values, each {wanted}"
        ok = isinstance(value, list | tuple) and (nargs == "+" or len(value) == nargs)
        ok = ok and all(_fits(scalar, v) for v in value)
        converted = tuple(scalar(v) for v in value) if ok else None
    if not ok:
        raise UserError(f"{where}: {key or name} must be {wanted}, got {value!r}")
    return converted


def _fits(scalar: type, value) -> bool:
    if scalar is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if scalar is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, scalar)


def from_record(record: dict, where: str) -> dict:
    """The settings of a saved run's configuration (a checkpoint's `config` entry, a
    config.json) that a new run takes over: not the `invocation` ones, which said where and how
    that run was started, and not keys this version does not know."""
    known = settings()
    out = {
        name: coerce(name, value, where)
        for name, value in record.items()
        if name in known and not known[name].metadata["invocation"]
    }
    # A record holds both; --lr-base, when set, is what decided the LR.
    out.pop("lr" if out.get("lr_base") is not None else "lr_base", None)
    return out


# Two ways to give one value: a layer that gives one replaces the other from the layers below.
_ALTERNATIVES = (("lr", "lr_base"),)


def _overlay(below: dict, layer: dict, where: str) -> dict:
    out = dict(below)
    for a, b in _ALTERNATIVES:
        if layer.get(a) is not None and layer.get(b) is not None:
            raise UserError(f"{where}: {flag_name(a)} and {flag_name(b)} both set the LR; give one")
        if a in layer:
            out.pop(b, None)
        if b in layer:
            out.pop(a, None)
    out.update(layer)
    return out


def merge(
    flags: dict,
    file: dict | None = None,
    saved: dict | None = None,
    file_name: str = "--config",
) -> tuple[Config, Layers]:
    """The run's Config from its layers, each above the one before: the defaults, `saved` (a
    resumed checkpoint's `config` entry), `file` (from `read`), `flags` (only the flags given);
    and its Layers: what `file` and `flags` set, and what `flags` set."""
    flags = {name: coerce(name, value, "command line") for name, value in flags.items()}
    user = _overlay(_overlay({}, file or {}, file_name), flags, "command line")
    below = from_record(saved or {}, "the checkpoint's config")
    # A checkpoint to resume, its settings not in yet: the checks of settings against each
    # other wait for them (Unsettled).
    made = Unsettled if not saved and user.get("resume") else Config
    try:
        config = made(**_overlay(below, user, "command line"))
    except UserError as err:
        # Config's checks name the flags at fault: when the file gave them all, say so.
        named = set(re.findall(r"--[a-z][a-z0-9-]*", str(err)))
        from_file = {flag_name(n) for n in file or {}} - {flag_name(n) for n in flags}
        if named and named <= from_file:
            raise UserError(f"{file_name}: {err}") from None
        raise
    return config, Layers(given=frozenset(user), on_command_line=frozenset(flags))


def resumed(config: Config, layers: Layers, saved_config: dict | None) -> Config:
    """config with a resumed checkpoint's settings (its `config` entry) under what the user gave
    (`layers.given`): the checkpoint layer of `merge`. Without a saved config, config itself."""
    if not saved_config:
        return config
    values = config.to_dict()
    given = {name: values[name] for name in layers.given}
    return merge(given, saved=saved_config)[0]


def recipes() -> list[str]:
    """The names of the shipped recipes (`--config recipe:NAME`)."""
    folder = importlib.resources.files("ddptrain") / "recipes"
    return sorted(
        p.name.removesuffix(".toml") for p in folder.iterdir() if p.name.endswith(".toml")
    )


def read(spec: str) -> dict:
    """The layer of `--config spec`: a TOML file, `recipe:NAME`, or a config.json a run wrote
    (whose `resolved` entry and invocation settings are left out, as from a checkpoint). Keys
    are long flag names, with dashes or underscores."""
    where = f"--config {spec}"
    text, is_json = _text(spec, where)
    try:
        raw = json.loads(text) if is_json else tomllib.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as err:
        raise UserError(f"{where}: not valid {'JSON' if is_json else 'TOML'} ({err})") from None
    if not isinstance(raw, dict):
        raise UserError(f"{where}: expected keys and values, got {type(raw).__name__}")
    record = "resolved" in raw
    layer: dict = {}
    for key, value in raw.items():
        if record and key == "resolved":
            continue
        name = _names().get(key)
        if name is None:
            raise UserError(
                f"{where}: unknown key {key!r}; keys are the long flag names of "
                "'ddptrain train --help', e.g. weight-decay or lr-scheduler"
            )
        if name in layer:
            raise UserError(f"{where}: {key!r} sets {flag_name(name)} a second time")
        layer[name] = value if record else coerce(name, value, where, key)
    return from_record(layer, where) if record else layer


def _text(spec: str, where: str) -> tuple[str, bool]:
    if spec.startswith(RECIPE):
        name = spec.removeprefix(RECIPE)
        path = importlib.resources.files("ddptrain") / "recipes" / f"{name}.toml"
        if not path.is_file():
            raise UserError(f"{where}: no such recipe; shipped: {', '.join(recipes())}")
        return path.read_text(), False
    path = Path(spec)
    try:
        return path.read_text(), path.suffix == ".json"
    except (OSError, UnicodeDecodeError) as err:
        reason = getattr(err, "strerror", None) or "not a text file"
        raise UserError(f"{where}: cannot read it ({reason})") from None


@functools.cache
def _names() -> dict[str, str]:
    """Every key a config file may use -> its field: the field name and each long flag name
    (--learning-rate, --wd), with dashes or underscores."""
    out = {}
    for name, f in settings().items():
        longs = [n[2:] for n in f.metadata["names"] if n.startswith("--")] or [name]
        for key in {name, *longs}:
            out[key.replace("-", "_")] = out[key.replace("_", "-")] = name
    return out
