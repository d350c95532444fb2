"""Reading and writing configs: TOML files, dotted command-line overrides (`--training.steps
200`), type checking with errors that name the field (and the field meant, for a typo), the
resolved config.toml and what changed in it since a run's previous start, the field reference
`distrain train --help-config` prints, and the commented default config `distrain init-config`
writes. The schema itself lives in schema.py."""

from __future__ import annotations

import dataclasses
import difflib
import textwrap
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, Literal

import tomli_w

from distrain.config.schema import Config
from distrain.errors import ConfigError, UsageError
from distrain.files import write_atomic, write_atomic_new


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(str(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        # `Literal["a", "none"] | None` reads "a | none": one name per choice.
        names = " | ".join(_describe(a) for a in typing.get_args(tp)).split(" | ")
        return " | ".join(dict.fromkeys(names))
    if tp is type(None):
        return "none"
    if origin is tuple:
        return f"array of {typing.get_args(tp)[0].__name__} tables"
    return getattr(tp, "__name__", str(tp))


def _field_types(section: Any) -> dict[str, Any]:
    return typing.get_type_hints(type(section))


def _coerce(name: str, tp: Any, value: Any, *, from_text: bool) -> Any:
    """Check `value` against the annotation `tp`; from_text parses command-line strings."""
    origin = typing.get_origin(tp)
    if origin is tuple:
        return _coerce_tables(name, typing.get_args(tp)[0], value, from_text=from_text)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(tp)
        if type(None) in options and (value is None or (from_text and value in ("none", "None"))):
            return None
        errors = []
        for option in (o for o in options if o is not type(None)):
            try:
                return _coerce(name, option, value, from_text=from_text)
            except ConfigError as e:
                errors.append(e)
        if len(errors) > 1:  # e.g. int | Literal["auto"]: name every choice
            raise ConfigError(f"{name}: expected {_describe(tp)}, got {value!r}")
        raise errors[0]
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value in allowed:
            return value
        if from_text:
            for a in allowed:
                if str(a).lower() == str(value).lower():
                    return a
        raise ConfigError(f"{name}: {value!r} is not allowed; choose one of {_describe(tp)}")
    if tp is bool:
        if isinstance(value, bool):
            return value
        if from_text and str(value).lower() in ("true", "1", "yes", "false", "0", "no"):
            return str(value).lower() in ("true", "1", "yes")
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if from_text:
            try:
                return int(value)
            except ValueError:
                pass
    elif tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if from_text:
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str):
            return value
    raise ConfigError(f"{name}: expected {_describe(tp)}, got {value!r}")


def _coerce_tables(name: str, table: type, value: Any, *, from_text: bool) -> tuple:
    """A tuple of `table` dataclasses from TOML's array of tables, or, for a table whose first
    fields are name and path, from the command line's NAME=PATH[,NAME=PATH...]."""
    if from_text and isinstance(value, str):
        first, second = (f.name for f in dataclasses.fields(table)[:2])
        if (first, second) != ("name", "path"):
            raise ConfigError(f"{name}: write it as [[{name}]] tables in the --config TOML file")
        items = []
        for part in (p for p in value.split(",") if p.strip()):
            key, sep, rest = part.partition("=")
            if not sep:
                raise ConfigError(
                    f"{name}: expected {first.upper()}={second.upper()}, got {part!r}"
                )
            items.append({first: key.strip(), second: rest.strip()})
        value = items
    if not isinstance(value, list | tuple):
        raise ConfigError(f"{name}: expected an array of tables ([[{name}]]), got {value!r}")
    hints = typing.get_type_hints(table)
    out = []
    for i, item in enumerate(value):
        if dataclasses.is_dataclass(item):
            out.append(item)
            continue
        if not isinstance(item, dict):
            raise ConfigError(f"{name}[{i}]: expected a table, got {item!r}")
        unknown = sorted(set(item) - set(hints))
        if unknown:
            raise ConfigError(
                f"{name}[{i}]: unknown key {unknown[0]!r}; the keys are {', '.join(hints)}"
            )
        out.append(
            table(
                **{
                    k: _coerce(f"{name}[{i}].{k}", hints[k], v, from_text=from_text)
                    for k, v in item.items()
                }
            )
        )
    return tuple(out)


# Fields that moved to another section: their old name is refused with the new one.
RENAMED_FIELDS = {
    "debug.collective_timeout_s": "comm.collective_timeout_s",
    "debug.hang_timeout_s": "watchdog.hang_timeout_s",
    "debug.straggler_ratio": "watchdog.straggler_ratio",
}


def field_names(node: Any, path: str = "") -> list[str]:
    """The dotted name of every field under `node` (a Config, or a section), nested ones too."""
    names = []
    for f in dataclasses.fields(node):
        name = f"{path}.{f.name}" if path else f.name
        value = getattr(node, f.name)
        names += field_names(value, name) if dataclasses.is_dataclass(value) else [name]
    return names


def _closest(dotted: str) -> str | None:
    close = difflib.get_close_matches(dotted, field_names(Config()), n=1, cutoff=0.75)
    return close[0] if close else None


def _unknown(dotted: str, choices: str) -> ConfigError:
    """The error for a field name that is not one: the field meant, else what there is."""
    meant = _closest(dotted)
    if meant is not None:
        section = meant.split(".", 1)[0]
        return ConfigError(
            f"unknown config field {dotted!r}; did you mean {meant!r}? "
            f"(`distrain train --help-config {section}` lists its section)"
        )
    return ConfigError(f"unknown config field {dotted!r}; {choices}")


def set_field(cfg: Config, dotted: str, value: Any, *, from_text: bool) -> None:
    """Set `section.field` (or `section.subsection.field`) on cfg, checking the name and type."""
    if dotted in RENAMED_FIELDS:
        raise ConfigError(f"config field {dotted!r} is now {RENAMED_FIELDS[dotted]!r}; write that")
    parts = dotted.split(".")
    known = cfg.sections()
    if len(parts) < 2 or parts[0] not in known:
        raise _unknown(
            dotted,
            f"sections are: {', '.join(known)} (write section.field, e.g. training.steps)",
        )
    node, path = known[parts[0]], parts[0]
    for name in parts[1:-1]:
        child = getattr(node, name, None) if name in _field_types(node) else None
        if not dataclasses.is_dataclass(child):
            raise _unknown(dotted, f"{path} has no section {name!r}")
        node, path = child, f"{path}.{name}"
    types_ = _field_types(node)
    leaf = parts[-1]
    if leaf not in types_ or dataclasses.is_dataclass(getattr(node, leaf)):
        fields = ", ".join(k for k in types_ if not dataclasses.is_dataclass(getattr(node, k)))
        raise _unknown(dotted, f"{path} has: {fields}")
    setattr(node, leaf, _coerce(dotted, types_[leaf], value, from_text=from_text))


def _flatten_table(prefix: str, table: dict[str, Any]) -> list[tuple[str, Any]]:
    items = []
    for key, value in table.items():
        name = f"{prefix}.{key}"
        items += _flatten_table(name, value) if isinstance(value, dict) else [(name, value)]
    return items


def toml_settings(path: str | Path) -> list[tuple[str, Any]]:
    """The fields the TOML file at `path` sets: (dotted name, value) in the file's order."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--config: no such file {str(p)!r}")
    try:
        data = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"--config {p}: not valid TOML ({e})") from e
    settings = []
    for section_name, values in data.items():
        if not isinstance(values, dict):
            raise ConfigError(f"{p}: top-level key {section_name!r} must be a [section] table")
        settings += _flatten_table(section_name, values)
    return settings


def parse_overrides(args: list[str]) -> list[tuple[str, str]]:
    """Turn ['--a.b', '1', '--c.d=x'] into [('a.b', '1'), ('c.d', 'x')]."""
    pairs: list[tuple[str, str]] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or "." not in arg:
            raise UsageError(
                f"unrecognized argument {arg!r}; config overrides look like --section.field VALUE"
            )
        key = arg[2:]
        if "=" in key:
            key, value = key.split("=", 1)
        else:
            if i + 1 >= len(args):
                raise UsageError(f"--{key}: missing value")
            i += 1
            value = args[i]
        pairs.append((key.replace("-", "_"), value))
        i += 1
    return pairs


def load_config(
    config_path: str | Path | None = None, overrides: list[tuple[str, Any]] | None = None
) -> Config:
    """Defaults < the TOML file < `overrides` (dotted name, value: a string is parsed as on the
    command line, any other value checked as it is), validated."""
    cfg = Config()
    for key, value in toml_settings(config_path) if config_path else []:
        set_field(cfg, key, value, from_text=False)
    for key, value in overrides or []:
        set_field(cfg, key, value, from_text=isinstance(value, str))
    cfg.validate()
    return cfg


def write_toml(cfg: Config, path: str | Path, *, replace: bool = True) -> None:
    """`cfg` as a TOML file at `path`, written whole or not at all; `replace=False`: a file
    already there is refused (ConfigError), not replaced."""
    text = tomli_w.dumps(cfg.to_dict())
    if replace:
        write_atomic(path, text)
        return
    try:
        write_atomic_new(path, text)
    except FileExistsError:
        raise ConfigError(f"{path}: a file is there already; name a new one") from None


WIDTH = 100
"""Columns of the field reference and of the commented default config."""


def _leaves(path: str, node: Any) -> list[tuple[str, str, Any, dataclasses.Field, Any]]:
    """(section path, dotted name, default, field, type) of every field under `node`, a
    section's own fields before its subsections'."""
    hints = _field_types(node)
    own, nested = [], []
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        if dataclasses.is_dataclass(value):
            nested += _leaves(f"{path}.{f.name}", value)
        else:
            own.append((path, f"{path}.{f.name}", value, f, hints[f.name]))
    return own + nested


def _signature(f: dataclasses.Field, tp: Any, value: Any) -> str:
    valid = f" {f.metadata['range']}," if "range" in f.metadata else ""
    return f"({_describe(tp)},{valid} default {value!r})"


def help_text(names: list[str] | None = None) -> str:
    """The fields of the sections `names` (default: all) with their type, range, default and
    meaning, wrapped to WIDTH columns, for `distrain train --help-config`."""
    lines = ["config fields (TOML [section] key, or --section.field VALUE on the command line):"]
    current = None
    for name, section in Config().sections().items():
        if names is not None and name not in names:
            continue
        for path, dotted, value, f, tp in _leaves(name, section):
            if path != current:
                lines += ["", f"[{path}]"]
                current = path
            lines += textwrap.wrap(
                f"{dotted} {_signature(f, tp, value)}", WIDTH, subsequent_indent="    "
            )
            lines += textwrap.wrap(
                f.metadata.get("help", ""), WIDTH, initial_indent="    ", subsequent_indent="    "
            )
    return "\n".join(lines)


def _toml_value(value: Any) -> str:
    return tomli_w.dumps({"x": value}).removeprefix("x = ").strip()


def default_config_toml(skip: tuple[str, ...] = ("debug",)) -> str:
    """Every field of every section but `skip` at its default, each under its help as a comment;
    a field whose default is None (TOML has none) stands commented out. Reading it back gives
    the defaults."""
    lines = [
        "# distrain config: every field at its default, with what it means.",
        "# Keep the lines you change; `distrain train --config FILE` reads it, and",
        "# --section.field VALUE on the command line wins over it.",
    ]
    current = None
    for name, section in Config().sections().items():
        if name in skip:
            continue
        for path, dotted, value, f, tp in _leaves(name, section):
            if path != current:
                lines += ["", f"[{path}]"]
                current = path
            comment = f"{f.metadata.get('help', '')} {_signature(f, tp, value)}"
            lines += textwrap.wrap(comment, WIDTH, initial_indent="# ", subsequent_indent="# ")
            key = dotted.rsplit(".", 1)[1]
            if value is None:
                lines.append(f"# {key} =")
            else:
                lines.append(f"{key} = {_toml_value(value)}")
    return "\n".join(lines) + "\n"


def config_changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """`name: old -> new` for every field whose value differs between `old` (a config.toml read
    back) and `new` (a config's `to_dict()`); a field missing from either side is None there."""
    before = dict(_flatten_table("", old))
    after = dict(_flatten_table("", new))
    return [
        f"{name[1:]}: {before.get(name)!r} -> {after.get(name)!r}"
        for name in dict.fromkeys([*before, *after])
        if before.get(name) != after.get(name)
    ]


def run_config_file(run_dir: Path) -> Path:
    """<run_dir>/config.toml, or the one error every command gives for a folder that is not a
    run directory."""
    path = Path(run_dir) / "config.toml"
    if not path.is_file():
        raise not_a_run_dir(run_dir, "config.toml")
    return path


def not_a_run_dir(run_dir: Path, missing: str) -> ConfigError:
    """The error for a RUN_DIR without `missing` (config.toml, logs/...)."""
    what = "does not exist" if not Path(run_dir).exists() else f"has no {missing}"
    return ConfigError(
        f"{run_dir}: not a distrain run directory (it {what}); give the run.dir of a run"
    )
