"""Reading and writing configs: TOML files, dotted command-line overrides (`--training.steps
200`), type checking with errors that name the field, the resolved config.toml, and the field
reference `distrain train --help` prints. The schema itself lives in schema.py."""

from __future__ import annotations

import dataclasses
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, Literal

import tomli_w

from distrain.config.schema import Config, sections, validate
from distrain.errors import ConfigError


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(str(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_describe(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "none"
    return getattr(tp, "__name__", str(tp))


def _field_types(section: Any) -> dict[str, Any]:
    return typing.get_type_hints(type(section))


def _coerce(name: str, tp: Any, value: Any, *, from_text: bool) -> Any:
    """Check `value` against the annotation `tp`; from_text parses command-line strings."""
    origin = typing.get_origin(tp)
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


# Fields that moved to another section: their old name is refused with the new one.
RENAMED_FIELDS = {
    "debug.collective_timeout_s": "comm.collective_timeout_s",
    "debug.hang_timeout_s": "watchdog.hang_timeout_s",
    "debug.straggler_ratio": "watchdog.straggler_ratio",
}


def set_field(cfg: Config, dotted: str, value: Any, *, from_text: bool) -> None:
    """Set `section.field` (or `section.subsection.field`) on cfg, checking the name and type."""
    if dotted in RENAMED_FIELDS:
        raise ConfigError(f"config field {dotted!r} is now {RENAMED_FIELDS[dotted]!r}; write that")
    parts = dotted.split(".")
    known = sections(cfg)
    if len(parts) < 2 or parts[0] not in known:
        raise ConfigError(
            f"unknown config field {dotted!r}; sections are: {', '.join(known)} "
            "(write section.field, e.g. training.steps)"
        )
    node, path = known[parts[0]], parts[0]
    for name in parts[1:-1]:
        child = getattr(node, name, None) if name in _field_types(node) else None
        if not dataclasses.is_dataclass(child):
            raise ConfigError(f"unknown config section {path}.{name!r} in {dotted!r}")
        node, path = child, f"{path}.{name}"
    types_ = _field_types(node)
    leaf = parts[-1]
    if leaf not in types_ or dataclasses.is_dataclass(getattr(node, leaf)):
        fields = ", ".join(k for k in types_ if not dataclasses.is_dataclass(getattr(node, k)))
        raise ConfigError(f"unknown config field {dotted!r}; {path} has: {fields}")
    setattr(node, leaf, _coerce(dotted, types_[leaf], value, from_text=from_text))


def _flatten_table(prefix: str, table: dict[str, Any]) -> list[tuple[str, Any]]:
    items = []
    for key, value in table.items():
        name = f"{prefix}.{key}"
        items += _flatten_table(name, value) if isinstance(value, dict) else [(name, value)]
    return items


def apply_toml(cfg: Config, path: str | Path) -> None:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--config: no such file {str(p)!r}")
    try:
        data = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"--config {p}: not valid TOML ({e})") from e
    for section_name, values in data.items():
        if not isinstance(values, dict):
            raise ConfigError(f"{p}: top-level key {section_name!r} must be a [section] table")
        for key, value in _flatten_table(section_name, values):
            set_field(cfg, key, value, from_text=False)


def parse_overrides(args: list[str]) -> list[tuple[str, str]]:
    """Turn ['--a.b', '1', '--c.d=x'] into [('a.b', '1'), ('c.d', 'x')]."""
    pairs: list[tuple[str, str]] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or "." not in arg:
            raise ConfigError(
                f"unrecognized argument {arg!r}; config overrides look like --section.field VALUE"
            )
        key = arg[2:]
        if "=" in key:
            key, value = key.split("=", 1)
        else:
            if i + 1 >= len(args):
                raise ConfigError(f"--{key}: missing value")
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
    if config_path:
        apply_toml(cfg, config_path)
    for key, value in overrides or []:
        set_field(cfg, key, value, from_text=isinstance(value, str))
    validate(cfg)
    return cfg


def _without_none(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_none(v) for k, v in value.items() if v is not None}
    return value


def to_dict(cfg: Config) -> dict[str, dict[str, Any]]:
    """A TOML-ready dict; None values are left out (TOML has no null)."""
    return {
        name: _without_none(dataclasses.asdict(section)) for name, section in sections(cfg).items()
    }


def write_toml(cfg: Config, path: str | Path) -> None:
    Path(path).write_text(tomli_w.dumps(to_dict(cfg)))


def _help_lines(path: str, node: Any) -> list[str]:
    lines = [f"  [{path}]"]
    hints = _field_types(node)
    nested = []
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        if dataclasses.is_dataclass(value):
            nested.append((f"{path}.{f.name}", value))
            continue
        valid = f" {f.metadata['range']}," if "range" in f.metadata else ""
        lines.append(
            f"    {path}.{f.name} ({_describe(hints[f.name])},{valid} default {value!r}): "
            f"{f.metadata.get('help', '')}"
        )
    for sub_path, sub in nested:
        lines += _help_lines(sub_path, sub)
    return lines


def help_text() -> str:
    """Every field with its type, default and meaning, for `distrain train --help`."""
    lines = ["config fields (TOML [section] key, or --section.field VALUE on the command line):"]
    for name, section in sections(Config()).items():
        lines += _help_lines(name, section)
    return "\n".join(lines)
