"""Parsing command lines: the parser every `distrain` command builds (one-line usage errors,
defaults shown, help wrapped to 100 columns), and `train`'s arguments (launcher options,
`--config`, dotted config overrides) into a validated Config. Used by the `distrain` command
(cli.py) and by the worker entry (`python -m distrain.train`, train/worker.py), so neither
imports the other."""

from __future__ import annotations

import argparse
import difflib
import shutil
import textwrap
from typing import Any, NoReturn

from distrain.config.io import WIDTH, help_text, load_config, parse_overrides
from distrain.config.schema import Config
from distrain.errors import ConfigError, UsageError


class HelpFormatter(argparse.HelpFormatter):
    """Help at most WIDTH columns wide, with each option's default after its help (not for
    flags, nor for options without one: their help says what happens then)."""

    def __init__(self, prog: str, **kwargs: Any):
        width = min(WIDTH, shutil.get_terminal_size((WIDTH, 24)).columns)
        super().__init__(prog, width=width, max_help_position=32, **kwargs)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        unset = default is None or default is False or default == [] or default is argparse.SUPPRESS
        if action.option_strings and not unset and "default" not in text:
            text += " (default: %(default)s)"
        return text


class CommandParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one `distrain: error: ...` line and exit 2
    (a UsageError for the `distrain` command to print), and whose help shows defaults."""

    def __init__(self, **kwargs: Any):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(**kwargs)

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (`{self.prog} --help` lists the options)")


def config_sections() -> list[str]:
    return list(Config().sections())


class ConfigHelp(argparse.Action):
    """`--help-config [SECTION]`: print the field reference (every section but debug, or one)
    and exit."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: Any, value: Any, *_: Any):
        known = config_sections()
        if value and value not in known:
            close = difflib.get_close_matches(value, known, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            parser.error(f"--help-config: no section {value!r}; {hint}sections: {', '.join(known)}")
        names = [value] if value else [s for s in known if s != "debug"]
        print(help_text(names))
        parser.exit()


def _train_epilog() -> str:
    text = (
        "Config fields are TOML [section] keys in --config FILE, or --section.field VALUE on the "
        "command line (which wins). Sections: "
        + ", ".join(config_sections())
        + ". `distrain train --help-config` lists every field with its type, range, default and "
        "meaning; `--help-config SECTION` one section (`debug` holds the developer switches, "
        "listed only so). `distrain init-config FILE` writes them all as a commented TOML file."
    )
    return textwrap.fill(text, WIDTH)


def train_parser(prog: str) -> argparse.ArgumentParser:
    parser = CommandParser(
        prog=prog,
        description="Train a model with the layout and settings of the config.",
        epilog=_train_epilog(),
        # Exact option names only: launcher options are stripped from the workers' arguments by
        # name, and an abbreviation would slip through to them.
        allow_abbrev=False,
    )
    parser.add_argument(
        "--help-config",
        nargs="?",
        const="",
        metavar="SECTION",
        action=ConfigHelp,
        help="List the config fields (of SECTION only) and exit.",
    )
    parser.add_argument("--config", help="TOML config file; command-line overrides win over it.")
    parser.add_argument(
        "--nproc",
        type=int,
        help="Local worker processes, started through torchrun (default: all GPUs, or 2 on CPU).",
    )
    parser.add_argument(
        "--nnodes",
        metavar="N|MIN:MAX",
        help="Nodes (machines, or agents) in the run. Giving this or any --rdzv-*/--node-rank "
        "option launches through an elastic c10d rendezvous instead of --standalone; with "
        "MIN:MAX the run starts once MIN nodes joined and the world size may change between "
        "attempts (the global batch stays fixed: accumulation makes up for missing ranks). "
        "Default: this node alone (--standalone).",
    )
    parser.add_argument(
        "--node-rank",
        metavar="R",
        help="This node's number in [0, MAX); node 0 hosts the rendezvous store at "
        "--rdzv-endpoint. Global ranks are assigned by the rendezvous (default: torchrun guesses "
        "the store host from the endpoint's address).",
    )
    parser.add_argument(
        "--rdzv-endpoint",
        metavar="HOST:PORT",
        help="Address of node 0's rendezvous store, the same on every node; needed when MAX > 1.",
    )
    parser.add_argument(
        "--rdzv-id",
        metavar="ID",
        help="Rendezvous (job) id, the same on every node; needed when MAX > 1 (default: an id "
        "unique to this launch).",
    )
    parser.add_argument(
        "--max-restarts",
        metavar="N",
        help="Restart the worker group up to N times after a worker fails (default: 0); every rank "
        "resumes from the newest complete checkpoint. Works with and without --nnodes.",
    )
    parser.add_argument(
        "--run-dir", help="Run directory (same as --run.dir; default: runs/default)."
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="Require a complete checkpoint in the run directory and continue from it.",
    )
    parser.add_argument(
        "--resume-from",
        metavar="STEP|PATH",
        help="STEP: continue from this run's checkpoint of that step, deleting its newer "
        "(non-permanent) checkpoints first; PATH: start from another run's checkpoint folder "
        "(<dir>/step-NNNNNNNN, same as --checkpoint.resume_from) when this run has none of its "
        "own (default: the newest checkpoint of this run).",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="Validate the config against the layout rules and the preflight checks for the "
        "world size, print the resolved layout, and exit without training.",
    )
    parser.add_argument(
        "--world-size",
        type=int,
        metavar="N",
        help="With --check: the ranks to check the layout for (default: --nproc x --nnodes).",
    )
    return parser


# Options read by the launcher only (option -> argparse dest); workers never see them.
LAUNCH_OPTIONS = {
    "--nproc": "nproc",
    "--nnodes": "nnodes",
    "--node-rank": "node_rank",
    "--rdzv-endpoint": "rdzv_endpoint",
    "--rdzv-id": "rdzv_id",
    "--max-restarts": "max_restarts",
    "--resume-from": "resume_from",
    "--world-size": "world_size",
}


def parse_train_args(argv: list[str], *, worker: bool) -> tuple[argparse.Namespace, Config]:
    """Parse `train` options plus dotted overrides into a validated Config."""
    parser = train_parser("python -m distrain.train" if worker else "distrain train")
    ns, rest = parser.parse_known_args(argv)
    overrides = parse_overrides(rest)
    if ns.run_dir is not None:
        overrides.append(("run.dir", ns.run_dir))
    if ns.resume:
        overrides.append(("run.resume", "true"))
    if ns.resume_from is not None and not ns.resume_from.isdigit():
        overrides.append(("checkpoint.resume_from", ns.resume_from))
    cfg = load_config(ns.config, overrides)
    if worker:
        given = [opt for opt, dest in LAUNCH_OPTIONS.items() if getattr(ns, dest) is not None]
        given += ["--check"] if ns.check else []
        if given:
            raise ConfigError(
                f"{', '.join(given)}: for `distrain train`; under torchrun use torchrun's own "
                "options (--nproc-per-node, --nnodes, --rdzv-endpoint, --max-restarts, ...)"
            )
    return ns, cfg


def int_option(name: str, text: str | None) -> int | None:
    if text is None:
        return None
    try:
        return int(text)
    except ValueError:
        raise UsageError(f"{name}: expected an integer, got {text!r}") from None


def strip_launch_options(argv: list[str]) -> list[str]:
    """`argv` without the options that only the launcher reads (`--opt V` and `--opt=V`); a
    `--resume-from PATH` reaches the workers as --checkpoint.resume_from."""
    out, skip = [], ""
    for arg in argv:
        option, _, value = arg.partition("=")
        if skip:
            option, value, skip = skip, arg, ""
        elif arg in LAUNCH_OPTIONS:
            skip = arg
            continue
        elif option not in LAUNCH_OPTIONS:
            out.append(arg)
            continue
        if option == "--resume-from" and not value.isdigit():
            out += ["--checkpoint.resume_from", value]
    return out
