"""The reference pages generated from the code: every config field (the dataclasses of
distrain/config/schema.py and debug.py, with type, default, range and help), every command and
option (the argparse parsers the commands build), and the layout-rule table (RULES of
distrain/layout/rules.py).

mkdocs runs this file as a hook (`hooks:` in mkdocs.yml): `on_files` adds the pages to the site
at every build, from the code of that build, so they are never stored and cannot go stale.
`python docs/gen_reference.py OUT_DIR` writes the same pages as Markdown files.

A command's parser is the one the command itself builds: each command is called with `--help`
while `ArgumentParser.parse_known_args` is replaced by a function that hands the parser back
(through `_Parser`) before anything is parsed, so the reference shows the parser `--help` uses.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import types
import typing
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

# --- config fields --------------------------------------------------------------------------


class FieldDoc(typing.NamedTuple):
    name: str
    type: str
    default: str
    range: str
    help: str


def config_fields() -> list[FieldDoc]:
    """Every leaf field of the config, in schema order, as a dotted name."""
    from distrain.config.schema import Config

    return list(_fields(Config(), ""))


def _fields(node: Any, prefix: str) -> Iterator[FieldDoc]:
    hints = typing.get_type_hints(type(node))
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        name = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            yield from _fields(value, f"{name}.")
            continue
        valid = f.metadata.get("range")
        yield FieldDoc(
            name=name,
            type=_type(hints[f.name]),
            default=_value(value),
            range="" if valid is None else str(valid),
            help=f.metadata.get("help", ""),
        )


def _type(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return " / ".join(_value(choice) for choice in typing.get_args(tp))
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        parts = [_type(arg) for arg in typing.get_args(tp) if arg is not type(None)]
        unset = " (or unset)" if type(None) in typing.get_args(tp) else ""
        return " or ".join(parts) + unset
    return tp.__name__


def _value(value: Any) -> str:
    """A value as it is written in a TOML file (None: the field is left unset)."""
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    return repr(value)


def config_page() -> str:
    lines = [
        "# Config reference",
        "",
        "Generated from the config schema at every build of this site. A field is set in a TOML",
        "file (`[section]` then `key = value`, passed with `--config`) or on the command line",
        "(`--section.field VALUE`); the command line wins over the file, the file over the",
        "defaults. *unset* means the field has no value of its own: the help says what is used",
        "then (the preset's value, for the model fields). *range* is the values a number",
        "accepts; a value outside it is refused in one line naming the field.",
    ]
    section = None
    for fd in config_fields():
        head = fd.name.rsplit(".", 1)[0]
        if head != section:
            section = head
            lines += ["", f"## `[{head}]`", "", "| field | type | default | range | meaning |"]
            lines += ["|---|---|---|---|---|"]
        cells = [f"`{fd.name}`", _cell(fd.type), f"`{fd.default}`", _cell(fd.range), fd.help]
        lines.append("| " + " | ".join(_escape(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


# --- commands and options -------------------------------------------------------------------


class _Parser(Exception):
    def __init__(self, parser: argparse.ArgumentParser):
        self.parser = parser


def _hand_back(self: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> Any:
    raise _Parser(self)


def captured_parser(call: Callable[[], Any]) -> argparse.ArgumentParser:
    """The first parser `call` builds and asks to parse, before it parses anything."""
    original = argparse.ArgumentParser.parse_known_args
    argparse.ArgumentParser.parse_known_args = _hand_back  # type: ignore[method-assign]
    try:
        call()
    except _Parser as found:
        return found.parser
    finally:
        argparse.ArgumentParser.parse_known_args = original  # type: ignore[method-assign]
    raise RuntimeError(f"{call} built no argument parser")


def command_parsers() -> dict[str, argparse.ArgumentParser]:
    """Each `distrain` command's parser, as `distrain COMMAND --help` builds it."""
    from distrain import cli

    parsers = {}
    for name in cli.COMMANDS:
        parser = captured_parser(lambda name=name: cli.main([name, "--help"]))
        parsers[name] = _subcommand(parser, name)
    return parsers


def _subcommand(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    """`name`'s parser when `parser` is a top-level parser with subcommands, else `parser`."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and name in action.choices:
            return action.choices[name]
    return parser


def options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The parser's documented arguments: every option and positional but `--help`."""
    return [a for a in parser._actions if not isinstance(a, argparse._HelpAction)]


def _flags(action: argparse.Action) -> str:
    if not action.option_strings:
        return f"`{action.metavar or action.dest}`"
    takes = "" if action.nargs == 0 else f" {_metavar(action)}"
    return ", ".join(f"`{flag}{takes}`" for flag in action.option_strings)


def _metavar(action: argparse.Action) -> str:
    if action.choices is not None:
        return "{" + ",".join(str(c) for c in action.choices) + "}"
    if isinstance(action.metavar, str):
        return action.metavar
    return action.dest.upper()


def _default(action: argparse.Action) -> str:
    if action.required:
        return "required"
    # A help text that names the default itself says it better (e.g. "all cores").
    if (
        action.nargs == 0
        or action.default in (None, argparse.SUPPRESS)
        or "default" in (action.help or "")
    ):
        return ""
    return f"`{_value(action.default)}`"


def cli_page() -> str:
    lines = [
        "# Command reference",
        "",
        "Generated from the commands' own argument parsers at every build of this site: what",
        "`distrain COMMAND --help` shows. `distrain train` also takes every config field as",
        "`--section.field VALUE` (see the [config reference](config.md)).",
        "",
        "| command | what it does |",
        "|---|---|",
    ]
    parsers = command_parsers()
    for name, parser in parsers.items():
        summary = " ".join((parser.description or "").split())
        lines.append(f"| [`distrain {name}`](#distrain-{name}) | {_escape(summary)} |")
    for name, parser in parsers.items():
        usage = " ".join(parser.format_usage().split()).removeprefix("usage: ")
        lines += ["", f"## `distrain {name}`", ""]
        if parser.description:
            lines += [" ".join(parser.description.split()), ""]
        lines += ["```text", usage, "```", ""]
        if not options(parser):
            lines.append("No options.")
            continue
        lines += ["| argument | default | meaning |", "|---|---|---|"]
        for action in options(parser):
            cells = [_flags(action), _default(action), " ".join((action.help or "").split())]
            lines.append("| " + " | ".join(_escape(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


# --- layout rules ---------------------------------------------------------------------------

NEEDS = {
    "config": "the config and the model shape",
    "world": "also the world size",
    "dims": "also the resolved parallel degrees",
}


def layout_rules_page() -> str:
    from distrain.layout.rules import RULES

    lines = [
        "# Layout rules",
        "",
        "Generated from the rule table at every build of this site. `distrain train` checks",
        "every rule before it starts a worker, and each worker checks them again; the first",
        "rule that refuses ends the run with its message, one line, before any step. *Needs*",
        "says what a rule reads: with `--nnodes MIN:MAX` the world size is known only at each",
        "rendezvous, so the rules that need it are checked by the workers. In a message,",
        "`{f....}` stands for the value of the config or layout it names.",
        "",
        "| # | rule | needs | message |",
        "|---|---|---|---|",
    ]
    for number, rule in enumerate(RULES, 1):
        cells = [str(number), f"`{rule.name}`", NEEDS[rule.needs], _cell(rule.message)]
        lines.append("| " + " | ".join(_escape(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


# --- Markdown --------------------------------------------------------------------------------


def _cell(text: str) -> str:
    return f"`{text}`" if text else ""


def _escape(text: str) -> str:
    """`text` as one table cell: a pipe outside a code span would end the cell (inside one it
    is literal, and an escape would show)."""
    parts = text.replace("\n", " ").split("`")
    return "`".join(p if i % 2 else p.replace("|", "\\|") for i, p in enumerate(parts))


def pages() -> dict[str, str]:
    return {
        "reference/config.md": config_page(),
        "reference/cli.md": cli_page(),
        "reference/layout-rules.md": layout_rules_page(),
    }


def on_files(files: Any, config: Any) -> Any:
    """mkdocs hook: the generated pages join the site's files."""
    from mkdocs.structure.files import File

    for uri, content in pages().items():
        files.append(File.generated(config, uri, content=content))
    return files


if __name__ == "__main__":
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "site-reference")
    for uri, content in pages().items():
        (out / uri).parent.mkdir(parents=True, exist_ok=True)
        (out / uri).write_text(content)
        print(out / uri)
