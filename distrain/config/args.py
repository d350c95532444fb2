"""Parsing `train` arguments: launcher options, `--config`, and dotted config overrides, into a
validated Config. Used by the `distrain train` command (cli.py) and by the worker entry
(`python -m distrain.train`, train/worker.py), so neither imports the other."""

from __future__ import annotations

import argparse

from distrain.config.io import help_text, load_config, parse_overrides
from distrain.config.schema import Config
from distrain.errors import ConfigError


def train_parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Train a GPT with the layout and settings of the config.",
        epilog=help_text(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        # Exact option names only: launcher options are stripped from the workers' arguments by
        # name, and an abbreviation would slip through to them.
        allow_abbrev=False,
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
        "attempts (the global batch stays fixed: accumulation makes up for missing ranks).",
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
        help="Restart the worker group up to N times after a worker fails (default 0); every rank "
        "resumes from the newest complete checkpoint. Works with and without --nnodes.",
    )
    parser.add_argument("--run-dir", help="Run directory (same as --run.dir).")
    parser.add_argument(
        "--resume",
        action="store_true",
        help="Require a complete checkpoint in the run directory and continue from it.",
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
    cfg = load_config(ns.config, overrides)
    if worker:
        given = [opt for opt, dest in LAUNCH_OPTIONS.items() if getattr(ns, dest) is not None]
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
        raise ConfigError(f"{name}: expected an integer, got {text!r}") from None


def strip_launch_options(argv: list[str]) -> list[str]:
    """`argv` without the options that only the launcher reads (`--opt V` and `--opt=V`)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in LAUNCH_OPTIONS:
            skip = True
        elif arg.split("=", 1)[0] not in LAUNCH_OPTIONS:
            out.append(arg)
    return out
