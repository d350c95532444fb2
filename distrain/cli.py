"""The `distrain` command: parses arguments, then hands off (train -> launch or worker; generate;
presets). Errors a user can fix print as one `distrain: error: ...` line with a non-zero exit."""

from __future__ import annotations

import argparse
import difflib
import sys
from pathlib import Path

import torch

from distrain.config.args import LAUNCH_OPTIONS, int_option, parse_train_args, strip_launch_options
from distrain.config.schema import Config
from distrain.errors import DistrainError


def default_nproc(cfg: Config) -> int:
    if cfg.run.device != "cpu" and torch.cuda.is_available():
        return torch.cuda.device_count()
    return 2


def cmd_train(argv: list[str]) -> None:
    from distrain.checkpoint.checkpointer import checkpoint_storage
    from distrain.launch.preflight import preflight
    from distrain.launch.torchrun import launch, make_plan, under_torchrun
    from distrain.layout.rules import validate

    if under_torchrun():
        from distrain.train.worker import run_training

        _, cfg = parse_train_args(argv, worker=True)
        run_training(cfg)
        return
    ns, cfg = parse_train_args(argv, worker=False)
    if _srun_task_per_process(ns, cfg):
        return
    plan = make_plan(
        ns.nproc if ns.nproc is not None else default_nproc(cfg),
        nnodes=ns.nnodes,
        node_rank=int_option("--node-rank", ns.node_rank),
        rdzv_endpoint=ns.rdzv_endpoint,
        rdzv_id=ns.rdzv_id,
        max_restarts=int_option("--max-restarts", ns.max_restarts) or 0,
        grace_s=cfg.checkpoint.preempt_grace_s,
    )
    # Whatever depends only on the config and the world size fails here, once, in one line,
    # before any worker starts. With MIN < MAX nodes the world size is only known at each
    # rendezvous; the workers check the rules that need it then.
    validate(cfg, plan.world_size)
    preflight(cfg)
    launch(
        plan,
        strip_launch_options(argv),
        run_dir=cfg.run.dir,
        checkpoints=checkpoint_storage(cfg),
    )


def _srun_task_per_process(ns: argparse.Namespace, cfg: Config) -> bool:
    """Under `srun` without launcher options, each task is one rank (no torchrun): translate
    SLURM_* into torch.distributed's variables, then train as a worker. False elsewhere."""
    import os

    from distrain.launch.slurm import srun_task_env, under_srun
    from distrain.train.worker import run_training

    if not under_srun() or any(getattr(ns, dest) is not None for dest in LAUNCH_OPTIONS.values()):
        return False
    os.environ.update(srun_task_env(os.environ))
    run_training(cfg)
    return True


CHECKPOINT_DIR_HELP = (
    "Where the run's checkpoints are, when not in the run folder (a path or URL): a run "
    "folder's own config.toml is not followed outside it."
)


def cmd_generate(argv: list[str]) -> None:
    from distrain.inference.generate import generate_text

    parser = argparse.ArgumentParser(prog="distrain generate", description="Sample from a run.")
    parser.add_argument("--run-dir", required=True, help="Run directory with a checkpoint.")
    parser.add_argument("--prompt", default="", help="Text to continue.")
    parser.add_argument(
        "--max-new-tokens", type=int, default=200, help="Tokens to sample after the prompt."
    )
    parser.add_argument("--temperature", type=float, default=0.8, help="0 = greedy.")
    parser.add_argument("--top-k", type=int, default=50, help="0 = no top-k filtering.")
    parser.add_argument("--seed", type=int, default=0, help="Seed of the sampling RNG.")
    parser.add_argument("--checkpoint-dir", default=None, help=CHECKPOINT_DIR_HELP)
    ns = parser.parse_args(argv)
    text = generate_text(
        Path(ns.run_dir),
        ns.prompt,
        max_new_tokens=ns.max_new_tokens,
        temperature=ns.temperature,
        top_k=ns.top_k or None,
        seed=ns.seed,
        checkpoint_dir=ns.checkpoint_dir,
    )
    print(text)


def cmd_prepare(argv: list[str]) -> None:
    import os

    from distrain.data.prepare import prepare

    parser = argparse.ArgumentParser(
        prog="distrain prepare",
        description="Tokenize text files, folders, JSONL files or a saved Hugging Face dataset "
        "into a token file for data.path (DATA.bin, its sidecar DATA.bin.json and document "
        "boundaries DATA.bin.docs.npy).",
    )
    parser.add_argument("inputs", nargs="+", metavar="INPUT", help="Files and folders to read.")
    parser.add_argument("--out", required=True, help="The token file to write (DATA.bin).")
    parser.add_argument(
        "--tokenizer",
        default="bytes",
        help="bytes, hf:DIR_OR_FILE or tiktoken:NAME_OR_FILE (what data.tokenizer takes).",
    )
    parser.add_argument(
        "--field", default="text", help="The text field of JSONL records and dataset rows."
    )
    parser.add_argument("--glob", default="**/*", help="Files to read in a folder.")
    parser.add_argument("--split", default="train", help="The split of a saved DatasetDict.")
    parser.add_argument("--eos", help="A token appended after each document (e.g. <|endoftext|>).")
    parser.add_argument(
        "--workers", type=int, default=os.cpu_count() or 1, help="Processes (default: all cores)."
    )
    ns = parser.parse_args(argv)
    result = prepare(
        ns.inputs,
        out=ns.out,
        tokenizer=ns.tokenizer,
        field=ns.field,
        glob=ns.glob,
        split=ns.split,
        eos=ns.eos,
        workers=ns.workers,
        progress=True,
    )
    s = result.sidecar
    print(
        f"{ns.out}: {s.num_tokens:,} tokens ({s.dtype}) in {s.num_documents:,} documents, "
        f"vocab {s.vocab_size}, {result.seconds:.1f} s ({result.tokens_per_s:,.0f} tokens/s)"
    )


def cmd_presets(argv: list[str]) -> None:
    from distrain.models.presets import PRESETS, num_params

    argparse.ArgumentParser(prog="distrain presets", description="List model presets.").parse_args(
        argv
    )
    print(f"{'preset':<12}{'params':>16}  dim  layers heads kv  ffn    vocab   mlp")
    for name, args in PRESETS.items():
        print(
            f"{name:<12}{num_params(args):>16,}  {args.dim:<4} {args.n_layers:<6} "
            f"{args.n_heads:<5} {args.kv_heads:<3} "
            f"{args.ffn_dim:<6} {args.vocab_size:<7} {args.mlp}"
        )


def cmd_slurm(argv: list[str]) -> None:
    from distrain.launch.slurm import slurm_command

    slurm_command(argv)


def cmd_diagnose(argv: list[str]) -> None:
    from distrain.observe.diagnose import diagnose

    parser = argparse.ArgumentParser(
        prog="distrain diagnose",
        description="What happened to a run: first failure and its traceback, hangs, restarts, "
        "last checkpoint.",
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="The run directory (run.dir).")
    print(diagnose(Path(parser.parse_args(argv).run_dir)))


def cmd_status(argv: list[str]) -> None:
    from distrain.observe.status import status

    parser = argparse.ArgumentParser(
        prog="distrain status",
        description="Where a run stands: last metrics, ETA, checkpoints, restarts.",
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="The run directory (run.dir).")
    print(status(Path(parser.parse_args(argv).run_dir)))


def cmd_plot(argv: list[str]) -> None:
    from distrain.observe.plots import write_plot

    parser = argparse.ArgumentParser(
        prog="distrain plot",
        description="Loss, val loss, lr, grad norm and tokens/s over steps, runs overlaid, "
        "as a PNG.",
    )
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="Run directories (run.dir).")
    parser.add_argument("--out", default="plot.png", help="PNG file to write (default: plot.png).")
    ns = parser.parse_args(argv)
    print(write_plot([Path(d) for d in ns.run_dirs], Path(ns.out)))


def cmd_export(argv: list[str]) -> None:
    from distrain.interop.export import DEFAULT_SHARD_MB, DTYPES, export_hf, export_program

    parser = argparse.ArgumentParser(
        prog="distrain export",
        description="A run's checkpoint as a Hugging Face model folder (transformers loads it) "
        "or a torch.export program.",
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="The run directory (run.dir).")
    parser.add_argument(
        "--format",
        choices=("hf", "torch-export"),
        default="hf",
        help="hf: a Hugging Face model folder; torch-export: a torch.export program (.pt2).",
    )
    parser.add_argument("--out", required=True, help="Folder (hf) or .pt2 file (torch-export).")
    parser.add_argument("--step", type=int, default=None, help="Checkpoint step (default: newest).")
    parser.add_argument(
        "--dtype", choices=tuple(DTYPES), default="fp32", help="Weight type of an hf export."
    )
    parser.add_argument(
        "--shard-mb", type=float, default=DEFAULT_SHARD_MB, help="Largest safetensors shard."
    )
    parser.add_argument("--checkpoint-dir", default=None, help=CHECKPOINT_DIR_HELP)
    ns = parser.parse_args(argv)
    if ns.shard_mb <= 0:
        parser.error(f"--shard-mb must be > 0, got {ns.shard_mb}")
    if ns.format == "hf":
        out = export_hf(
            Path(ns.run_dir),
            Path(ns.out),
            step=ns.step,
            dtype=ns.dtype,
            shard_mb=ns.shard_mb,
            checkpoint_dir=ns.checkpoint_dir,
        )
    else:
        out = export_program(
            Path(ns.run_dir), Path(ns.out), step=ns.step, checkpoint_dir=ns.checkpoint_dir
        )
    print(out)


def cmd_plan(argv: list[str]) -> None:
    from distrain.plan.command import plan_command

    plan_command(argv)


COMMANDS = {
    "train": cmd_train,
    "generate": cmd_generate,
    "presets": cmd_presets,
    "slurm": cmd_slurm,
    "diagnose": cmd_diagnose,
    "status": cmd_status,
    "plot": cmd_plot,
    "prepare": cmd_prepare,
    "export": cmd_export,
    "plan": cmd_plan,
}


USAGE = f"usage: distrain {{{','.join(COMMANDS)}}} [options]   (distrain COMMAND --help)"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    if argv[0] not in COMMANDS:
        close = difflib.get_close_matches(argv[0], COMMANDS, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        print(
            f"distrain: error: unknown command {argv[0]!r}; {hint}commands: {', '.join(COMMANDS)}",
            file=sys.stderr,
        )
        return 2
    try:
        COMMANDS[argv[0]](argv[1:])
    except DistrainError as e:
        print(f"distrain: {e.label}: {e}", file=sys.stderr)
        return e.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
