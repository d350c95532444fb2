"""The `distrain` command: parses arguments, then hands off (train -> launch or worker; generate;
presets). Errors a user can fix print as one `distrain: error: ...` line with a non-zero exit."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from distrain.config import Config, ConfigError
from distrain.config_io import help_text, load_config, parse_overrides
from distrain.errors import DistrainError


def _train_parser(prog: str) -> argparse.ArgumentParser:
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
        help="Rendezvous (job) id, the same on every node (default: 'distrain').",
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
    parser = _train_parser("python -m distrain.train" if worker else "distrain train")
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


def default_nproc(cfg: Config) -> int:
    if cfg.run.device != "cpu" and torch.cuda.is_available():
        return torch.cuda.device_count()
    return 2


def cmd_train(argv: list[str]) -> None:
    from distrain.checkpoint import checkpoint_storage
    from distrain.launch import launch, make_plan, under_torchrun
    from distrain.mesh import ParallelDims

    if under_torchrun():
        from distrain.train import run_training

        _, cfg = parse_train_args(argv, worker=True)
        run_training(cfg)
        return
    ns, cfg = parse_train_args(argv, worker=False)
    if _srun_task_per_process(ns, cfg):
        return
    plan = make_plan(
        ns.nproc if ns.nproc is not None else default_nproc(cfg),
        nnodes=ns.nnodes,
        node_rank=_int_option("--node-rank", ns.node_rank),
        rdzv_endpoint=ns.rdzv_endpoint,
        rdzv_id=ns.rdzv_id,
        max_restarts=_int_option("--max-restarts", ns.max_restarts) or 0,
        grace_s=cfg.checkpoint.preempt_grace_s,
    )
    # Fail here, in one line, before starting any worker. With MIN < MAX nodes the world size is
    # only known at each rendezvous; the workers check the layout against it then.
    if plan.world_size is not None:
        ParallelDims.from_config(cfg, plan.world_size)
    launch(
        plan,
        _strip_launch_options(argv),
        run_dir=cfg.run.dir,
        checkpoints=checkpoint_storage(cfg),
    )


def _srun_task_per_process(ns: argparse.Namespace, cfg: Config) -> bool:
    """Under `srun` without launcher options, each task is one rank (no torchrun): translate
    SLURM_* into torch.distributed's variables, then train as a worker. False elsewhere."""
    import os

    from distrain.slurm import srun_task_env, under_srun
    from distrain.train import run_training

    if not under_srun() or any(getattr(ns, dest) is not None for dest in LAUNCH_OPTIONS.values()):
        return False
    os.environ.update(srun_task_env(os.environ))
    run_training(cfg)
    return True


def _int_option(name: str, text: str | None) -> int | None:
    if text is None:
        return None
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"{name}: expected an integer, got {text!r}") from None


def _strip_launch_options(argv: list[str]) -> list[str]:
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


def cmd_generate(argv: list[str]) -> None:
    from distrain.generate import generate_text

    parser = argparse.ArgumentParser(prog="distrain generate", description="Sample from a run.")
    parser.add_argument("--run-dir", required=True, help="Run directory with a checkpoint.")
    parser.add_argument("--prompt", default="", help="Text to continue.")
    parser.add_argument("--max-new-tokens", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=0.8, help="0 = greedy.")
    parser.add_argument("--top-k", type=int, default=50, help="0 = no top-k filtering.")
    parser.add_argument("--seed", type=int, default=0)
    ns = parser.parse_args(argv)
    text = generate_text(
        Path(ns.run_dir),
        ns.prompt,
        max_new_tokens=ns.max_new_tokens,
        temperature=ns.temperature,
        top_k=ns.top_k or None,
        seed=ns.seed,
    )
    print(text)


def cmd_presets(argv: list[str]) -> None:
    from distrain.models.presets import PRESETS, num_params

    argparse.ArgumentParser(prog="distrain presets", description="List model presets.").parse_args(
        argv
    )
    print(f"{'preset':<12}{'params':>16}  dim  layers heads  ffn    vocab")
    for name, args in PRESETS.items():
        print(
            f"{name:<12}{num_params(args):>16,}  {args.dim:<4} {args.n_layers:<6} "
            f"{args.n_heads:<5} "
            f"{args.ffn_dim:<6} {args.vocab_size}"
        )


def cmd_slurm(argv: list[str]) -> None:
    from distrain.slurm import slurm_command

    slurm_command(argv)


COMMANDS = {
    "train": cmd_train,
    "generate": cmd_generate,
    "presets": cmd_presets,
    "slurm": cmd_slurm,
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print(
            "usage: distrain {train,generate,presets,slurm} [options]   (distrain COMMAND --help)"
        )
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    try:
        COMMANDS[argv[0]](argv[1:])
    except DistrainError as e:
        print(f"distrain: {e.label}: {e}", file=sys.stderr)
        return e.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
