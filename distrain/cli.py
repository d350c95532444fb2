"""The `distrain` command: the command table (name, one-line summary, argument parser, what it
runs), the top-level help and `--version`, and the dispatch. Errors a user can fix print as one
`distrain: error: ...` line with a non-zero exit (2 for a command line that does not parse).

Nothing here imports torch at module level: `--help` of every command answers without it, and
a command imports what it needs when it runs."""

from __future__ import annotations

import argparse
import difflib
import gc
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from distrain.config.args import (
    LAUNCH_OPTIONS,
    CommandParser,
    int_option,
    parse_train_args,
    strip_launch_options,
    train_parser,
)
from distrain.config.schema import CheckpointConfig, Config, FaultToleranceConfig, ModelConfig
from distrain.errors import ConfigError, DistrainError, MissingInput
from distrain.version import version

CHECKPOINT_DIR_HELP = (
    "Where the run's checkpoints are, when not in the run folder (a path or URL): a run "
    "folder's own config.toml is not followed outside it (default: the run's checkpoint.dir)."
)
RUN_DIR_HELP = "The run directory (the run's run.dir)."


def default_nproc(device: str) -> int:
    """Processes per node when --nproc is not given: every local GPU, else 2 (CPU)."""
    import torch

    if device != "cpu" and torch.cuda.is_available():
        return torch.cuda.device_count()
    return 2


def cmd_train(argv: list[str]) -> None:
    # --help, --help-config and usage errors answer here, before torch loads with the launcher.
    train_parser("distrain train").parse_known_args(argv)
    from distrain.launch.torchrun import under_torchrun

    if under_torchrun():
        from distrain.train.worker import run_training

        _, cfg = parse_train_args(argv, worker=True)
        run_training(cfg)
        return
    ns, cfg = parse_train_args(argv, worker=False)
    if ns.world_size is not None and not ns.check:
        raise ConfigError("--world-size: only with --check (training takes it from the launch)")
    if ns.check:
        _check(ns, cfg)
        return
    if _srun_task_is_a_rank(ns):
        from distrain.train.worker import run_training

        run_training(cfg)
        return
    from distrain.checkpoint.checkpointer import checkpoint_storage
    from distrain.launch.preflight import preflight
    from distrain.launch.torchrun import launch
    from distrain.layout.rules import validate
    from distrain.optim.diloco_resume import check_resume_sites

    plan = _launch_plan(ns, cfg.run.device, cfg.checkpoint.preempt_grace_s, cfg.fault_tolerance)
    # Whatever depends only on the config and the world size fails here, once, in one line,
    # before any worker starts. With MIN < MAX nodes the world size is only known at each
    # rendezvous; the workers check the rules that need it then.
    validate(cfg, plan.world_size)
    preflight(cfg)
    _check_model(cfg.model, cfg.checkpoint, cfg.run.dir)
    if ns.resume_from is not None and ns.resume_from.isdigit():
        _rewind(cfg.checkpoint, cfg.run.dir, int(ns.resume_from))
    check_resume_sites(cfg.diloco, cfg.parallel.dp_replicate, cfg.checkpoint, cfg.run.dir)
    launch(
        plan,
        strip_launch_options(argv),
        run_dir=cfg.run.dir,
        checkpoints=checkpoint_storage(cfg.checkpoint, cfg.run.dir),
    )


def _launch_plan(
    ns: argparse.Namespace, device: str, grace_s: float, ft: FaultToleranceConfig
):  # -> LaunchPlan
    """The launch of this node's workers: --nproc or `default_nproc` (for run.device), sized
    beside the replica groups sharing this host; `grace_s`: checkpoint.preempt_grace_s."""
    from distrain.ft.network import groups_on_this_host
    from distrain.launch.torchrun import make_plan

    return make_plan(
        ns.nproc if ns.nproc is not None else default_nproc(device),
        nnodes=ns.nnodes,
        node_rank=int_option("--node-rank", ns.node_rank),
        rdzv_endpoint=ns.rdzv_endpoint,
        rdzv_id=ns.rdzv_id,
        max_restarts=int_option("--max-restarts", ns.max_restarts) or 0,
        grace_s=grace_s,
        local_groups=groups_on_this_host(ft.replica_groups, ft.lighthouse),
    )


def _check(ns: argparse.Namespace, cfg: Config) -> None:
    """`train --check`: the layout rules and the preflight checks, and the layout they resolve,
    for --world-size ranks (or those the launch options give); nothing is trained or written."""
    from distrain.launch.preflight import preflight
    from distrain.layout.rules import validate

    world_size = ns.world_size
    if world_size is None:
        launch = (cfg.run.device, cfg.checkpoint.preempt_grace_s, cfg.fault_tolerance)
        world_size = _launch_plan(ns, *launch).world_size
    absent: list[str] = []
    layout = validate(cfg, world_size, absent=absent)
    preflight(cfg, absent=absent)
    _check_model(cfg.model, cfg.checkpoint, cfg.run.dir, absent=absent)
    print(f"distrain: config ok for {world_size if world_size else 'an elastic'} rank(s)")
    print(f"  model: {layout.spec.name} {cfg.model.preset}, {layout.spec.describe(layout.model)}")
    if layout.dims is not None:
        d = layout.dims
        print(
            f"  layout: pp {d.pp} x dp_replicate {d.dp_replicate} x dp_shard {d.dp_shard} x "
            f"cp {d.cp} x tp {d.tp} (ep {d.ep})\n"
            f"  data parallelism: ZeRO stage {d.zero_stage}, wrapper {d.dp_wrapper}"
        )
    t = cfg.training
    print(
        f"  batch: global {t.global_batch_size} sequences of {t.seq_len} tokens, "
        f"micro-batch {t.micro_batch_size}, precision {t.precision}, {t.steps} steps"
    )
    for note in absent:
        print(f"  not checked (absent here): {note}")


def _check_model(
    model: ModelConfig, checkpoint: CheckpointConfig, run_dir: str, absent: list[str] | None = None
) -> None:
    """Before any worker starts: the checkpoint the start would resume (of `run_dir`, in
    `checkpoint`'s storage) holds `model` (launch/preflight.py compares it with the manifest's
    record); a start from a
    `model.init_from` folder finds its weights readable (models/hf_files.py). With `absent`
    (`train --check`), a Hugging Face folder that is not here is noted instead."""
    from distrain.launch.preflight import check_resume_model, resumed_checkpoint
    from distrain.models.hf_files import check_weights, hf_dir
    from distrain.models.registry import model_record

    try:
        resumed = resumed_checkpoint(checkpoint, run_dir)
        if resumed is not None:
            check_resume_model(run_dir, *resumed, wanted=model_record(model))
        elif model.init_from:
            check_weights(hf_dir(model.init_from))
    except MissingInput as e:
        if absent is None:
            raise
        if not any(note.startswith(str(e)) for note in absent):  # the rules may have said it
            absent.append(str(e))


def _rewind(checkpoint: CheckpointConfig, run_dir_name: str, step: int) -> None:
    """`train --resume-from STEP`: delete this run's checkpoints newer than STEP so that the
    workers resume from it (and a restart later resumes from the run's own newest again)."""
    from distrain.checkpoint.checkpointer import checkpoint_storage
    from distrain.checkpoint.manifest import rewind
    from distrain.launch.rundir import RunDirLock

    run_dir = Path(run_dir_name)
    lock = RunDirLock(run_dir).acquire() if run_dir.is_dir() else None
    try:
        removed = rewind(checkpoint_storage(checkpoint, run_dir_name), step)
    finally:
        if lock is not None:
            lock.release()
    if removed:
        print(
            f"distrain: --resume-from {step}: deleted the newer checkpoints {', '.join(removed)}",
            file=sys.stderr,
        )


def _srun_task_is_a_rank(ns: argparse.Namespace) -> bool:
    """Under `srun` without launcher options, each task is one rank (no torchrun): SLURM_*
    translated into torch.distributed's variables, True (the caller trains as a worker). False
    elsewhere."""
    from distrain.launch.slurm import srun_task_env, under_srun

    if not under_srun() or any(getattr(ns, dest) is not None for dest in LAUNCH_OPTIONS.values()):
        return False
    os.environ.update(srun_task_env(os.environ))
    return True


def generate_parser() -> argparse.ArgumentParser:
    parser = CommandParser(prog="distrain generate", description="Sample text from a run.")
    parser.add_argument("--run-dir", required=True, help="Run directory with a checkpoint.")
    parser.add_argument("--prompt", default="", help="Text to continue (default: none).")
    parser.add_argument(
        "--max-new-tokens", type=int, default=200, help="Tokens to sample after the prompt."
    )
    parser.add_argument(
        "--temperature", type=float, default=0.8, help="Softmax temperature; 0 = greedy."
    )
    parser.add_argument("--top-k", type=int, default=50, help="0 = no top-k filtering.")
    parser.add_argument("--seed", type=int, default=0, help="Seed of the sampling.")
    parser.add_argument("--checkpoint-dir", default=None, help=CHECKPOINT_DIR_HELP)
    return parser


def cmd_generate(argv: list[str]) -> None:
    ns = generate_parser().parse_args(argv)
    from distrain.inference.generate import generate_text

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


def eval_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="distrain eval",
        description="Run lm-evaluation-harness tasks on a run's checkpoint (any layout); results "
        "go to RUN_DIR/eval/step-NNNNNNNN.json, a metrics.jsonl row (eval/TASK/METRIC) and the "
        'run\'s trackers. Needs the eval extra (`pip install -e ".[eval]"` in a checkout).',
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help=RUN_DIR_HELP)
    parser.add_argument(
        "--tasks", required=True, help="Comma-separated task names (lm-evaluation-harness's)."
    )
    parser.add_argument(
        "--step", type=int, default=None, help="The checkpoint's step (default: the newest)."
    )
    parser.add_argument(
        "--limit",
        type=int,
        default=None,
        help="At most this many examples per task (default: all).",
    )
    parser.add_argument(
        "--include-path",
        default=None,
        help="A folder of task YAML files (with their local data) to take the tasks from instead "
        "of the harness's own list. The harness imports the Python files such a folder names "
        "(task hooks, utils.py): give only folders you would run as code.",
    )
    parser.add_argument(
        "--batch-size", type=int, default=16, help="Requests scored in one forward pass."
    )
    parser.add_argument("--checkpoint-dir", default=None, help=CHECKPOINT_DIR_HELP)
    return parser


def cmd_eval(argv: list[str]) -> None:
    ns = eval_parser().parse_args(argv)
    from distrain.evaluate.downstream import run_eval

    path, row = run_eval(
        Path(ns.run_dir),
        tasks=[t.strip() for t in ns.tasks.split(",") if t.strip()],
        step=ns.step,
        limit=ns.limit,
        include_path=Path(ns.include_path) if ns.include_path else None,
        batch_size=ns.batch_size,
        checkpoint_dir=ns.checkpoint_dir,
    )
    for key, value in row.items():
        if key != "step":
            print(f"{key} = {value:.4f}")
    print(path)


def prepare_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="distrain prepare",
        description="Tokenize text files, folders, JSONL files or a saved Hugging Face dataset "
        "into a token file for data.path (DATA.bin, its sidecar DATA.bin.json and document "
        "boundaries DATA.bin.docs.npy), or with --shard-tokens into a dataset folder of shards "
        "and index.json (resumed where it stopped when run again).",
    )
    parser.add_argument("inputs", nargs="+", metavar="INPUT", help="Files and folders to read.")
    parser.add_argument(
        "--out",
        required=True,
        help="The token file to write (DATA.bin), or with --shard-tokens the dataset folder.",
    )
    parser.add_argument(
        "--shard-tokens",
        type=int,
        default=0,
        help="Write a sharded dataset folder, each shard at most this many tokens (0 = one file).",
    )
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
    parser.add_argument(
        "--eos", help="A token appended after each document, e.g. <|endoftext|> (default: none)."
    )
    parser.add_argument(
        "--chat-template",
        metavar="FILE",
        help="For conversations (JSONL with messages, or prompt and completion): a Jinja chat "
        "template file to render them with (default: the --tokenizer folder's own).",
    )
    parser.add_argument(
        "--loss-on",
        choices=("assistant", "all"),
        default="assistant",
        help="For conversations: the tokens that count for the loss, the assistant's answers "
        "(the completion) or all (default: assistant).",
    )
    parser.add_argument("--workers", type=int, default=None, help="Processes (default: all cores).")
    return parser


def cmd_prepare(argv: list[str]) -> None:
    ns = prepare_parser().parse_args(argv)
    from distrain.data.prepare import prepare

    result = prepare(
        ns.inputs,
        out=ns.out,
        tokenizer=ns.tokenizer,
        field=ns.field,
        glob=ns.glob,
        split=ns.split,
        eos=ns.eos,
        workers=ns.workers or os.cpu_count() or 1,
        progress=True,
        shard_tokens=ns.shard_tokens,
        chat_template=ns.chat_template,
        loss_on=ns.loss_on,
    )
    s = result.sidecar
    print(
        f"{ns.out}: {s.num_tokens:,} tokens ({s.dtype}) in {s.num_documents:,} documents, "
        f"vocab {s.vocab_size}, {result.seconds:.1f} s ({result.tokens_per_s:,.0f} tokens/s)"
    )


def presets_parser() -> argparse.ArgumentParser:
    return CommandParser(
        prog="distrain presets",
        description="List the model families (model.family), their presets (model.preset) "
        "and sizes.",
    )


def cmd_presets(argv: list[str]) -> None:
    presets_parser().parse_args(argv)
    from distrain.models.registry import families

    rows = [
        (spec.name, name, f"{spec.num_params(args):,}", spec.describe(args))
        for spec in families().values()
        for name, args in spec.presets.items()
    ]
    header = ("family", "preset", "params", "shape")
    family, preset, params = (max(len(r[i]) for r in [header, *rows]) for i in range(3))
    for row in [header, *rows]:
        print(f"{row[0]:<{family}}  {row[1]:<{preset}}  {row[2]:>{params}}  {row[3]}")


def diagnose_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="distrain diagnose",
        description="What happened to a run: first failure and its traceback, hangs, restarts, "
        "last checkpoint.",
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help=RUN_DIR_HELP)
    return parser


def cmd_diagnose(argv: list[str]) -> None:
    run_dir = Path(diagnose_parser().parse_args(argv).run_dir)
    from distrain.observe.diagnose import diagnose

    print(diagnose(run_dir))


def status_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="distrain status",
        description="Where a run stands: last metrics, ETA, checkpoints, restarts.",
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help=RUN_DIR_HELP)
    return parser


def cmd_status(argv: list[str]) -> None:
    run_dir = Path(status_parser().parse_args(argv).run_dir)
    from distrain.observe.status import status

    print(status(run_dir))


def plot_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="distrain plot",
        description="Loss, val loss, lr, grad norm and tokens/s over steps, runs overlaid, "
        "as a PNG.",
    )
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="Run directories (run.dir).")
    parser.add_argument("--out", default="plot.png", help="PNG file to write.")
    return parser


def cmd_plot(argv: list[str]) -> None:
    ns = plot_parser().parse_args(argv)
    from distrain.observe.plots import write_plot

    print(write_plot([Path(d) for d in ns.run_dirs], Path(ns.out)))


# interop/export.py's DTYPES and DEFAULT_SHARD_MB, here without importing torch for --help
# (tests/test_cli.py holds them equal).
EXPORT_DTYPES = ("fp32", "bf16", "fp16")
EXPORT_SHARD_MB = 2048


def export_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="distrain export",
        description="A run's checkpoint as a Hugging Face model folder (transformers loads it; "
        "a LoRA run's with its adapters merged), a PEFT adapter folder (a LoRA run's adapters, "
        "which peft loads onto the base model) or a torch.export program.",
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help=RUN_DIR_HELP)
    parser.add_argument(
        "--format",
        choices=("hf", "peft", "torch-export"),
        default="hf",
        help="hf: a Hugging Face folder (safetensors); peft: a LoRA run's adapter folder; "
        "torch-export: a .pt2 program.",
    )
    parser.add_argument(
        "--out", required=True, help="Folder (hf, peft) or .pt2 file (torch-export)."
    )
    parser.add_argument("--step", type=int, default=None, help="Checkpoint step (default: newest).")
    parser.add_argument(
        "--dtype", choices=EXPORT_DTYPES, default="fp32", help="Weight type of an hf export."
    )
    parser.add_argument(
        "--shard-mb", type=float, default=EXPORT_SHARD_MB, help="Largest safetensors shard."
    )
    parser.add_argument("--checkpoint-dir", default=None, help=CHECKPOINT_DIR_HELP)
    return parser


def cmd_export(argv: list[str]) -> None:
    parser = export_parser()
    ns = parser.parse_args(argv)
    if ns.shard_mb <= 0:
        parser.error(f"--shard-mb must be > 0, got {ns.shard_mb}")
    from distrain.interop.export import export_hf, export_peft, export_program

    if ns.format == "hf":
        out = export_hf(
            Path(ns.run_dir),
            Path(ns.out),
            step=ns.step,
            dtype=ns.dtype,
            shard_mb=ns.shard_mb,
            checkpoint_dir=ns.checkpoint_dir,
        )
    elif ns.format == "peft":
        out = export_peft(
            Path(ns.run_dir), Path(ns.out), step=ns.step, checkpoint_dir=ns.checkpoint_dir
        )
    else:
        out = export_program(
            Path(ns.run_dir), Path(ns.out), step=ns.step, checkpoint_dir=ns.checkpoint_dir
        )
    print(out)


def init_config_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="distrain init-config",
        description="Write a config with every field at its default, each under its help as a "
        "comment (the debug section left out), to copy and edit for --config.",
    )
    parser.add_argument(
        "file", nargs="?", metavar="FILE", help="TOML file to write (default: print it)."
    )
    parser.add_argument("--force", action="store_true", help="Replace FILE if it exists.")
    return parser


def cmd_init_config(argv: list[str]) -> None:
    from distrain.config.io import default_config_toml

    ns = init_config_parser().parse_args(argv)
    text = default_config_toml()
    if ns.file is None:
        print(text, end="")
        return
    path = Path(ns.file)
    if path.exists() and not ns.force:
        raise ConfigError(f"{path} exists; choose another FILE or add --force to replace it")
    path.write_text(text)
    print(f"distrain: wrote {path}; train with: distrain train --config {path}")


def _slurm_parser() -> argparse.ArgumentParser:
    from distrain.launch.slurm import slurm_parser

    return slurm_parser()


def cmd_slurm(argv: list[str]) -> None:
    from distrain.launch.slurm import slurm_command

    slurm_command(argv)


def _plan_parser() -> argparse.ArgumentParser:
    from distrain.plan.command import parser

    return parser()


def cmd_plan(argv: list[str]) -> None:
    from distrain.plan.command import plan_command

    plan_command(argv)


def _lighthouse_parser() -> argparse.ArgumentParser:
    from distrain.ft.lighthouse import lighthouse_parser

    return lighthouse_parser()


def cmd_lighthouse(argv: list[str]) -> None:
    from distrain.ft.lighthouse import lighthouse_command

    lighthouse_command(argv)


@dataclass(frozen=True)
class Command:
    """One `distrain` command: what `distrain --help` says of it, its parser (for its help and
    the reference docs), and what runs it on its arguments."""

    summary: str
    parser: Callable[[], argparse.ArgumentParser]
    run: Callable[[list[str]], None]
    quick_exit: bool = False
    """The `distrain` process leaves what the command made to its exit, skipping the
    interpreter's last garbage collection (`program`): for a command that prints its answer and
    holds nothing open (after a cold plan that collection walks every object torch and the plan
    made: 0.6 s)."""


COMMANDS: dict[str, Command] = {
    "train": Command(
        "Train a model: launch workers on this node (torchrun) or run as one.",
        lambda: train_parser("distrain train"),
        cmd_train,
    ),
    "generate": Command("Sample text from a run's checkpoint.", generate_parser, cmd_generate),
    "eval": Command("Run lm-evaluation-harness tasks on a checkpoint.", eval_parser, cmd_eval),
    "presets": Command("List the model presets and their sizes.", presets_parser, cmd_presets),
    "slurm": Command("Write and submit an sbatch script for a run.", _slurm_parser, cmd_slurm),
    "diagnose": Command("Explain what happened to a run.", diagnose_parser, cmd_diagnose),
    "status": Command("Show where a run stands.", status_parser, cmd_status),
    "plot": Command("Plot runs' metrics as a PNG.", plot_parser, cmd_plot),
    "prepare": Command("Tokenize text into a token file.", prepare_parser, cmd_prepare),
    "export": Command("Export a checkpoint (Hugging Face, .pt2).", export_parser, cmd_export),
    "plan": Command(
        "Rank the layouts of a model on a cluster.", _plan_parser, cmd_plan, quick_exit=True
    ),
    "lighthouse": Command(
        "Run the quorum server of replica groups (torchft's lighthouse protocol).",
        _lighthouse_parser,
        cmd_lighthouse,
    ),
    "init-config": Command(
        "Write a commented config with every default.", init_config_parser, cmd_init_config
    ),
}


def top_help() -> str:
    width = max(len(name) for name in COMMANDS) + 2
    rows = "\n".join(f"  {name:<{width}}{c.summary}" for name, c in COMMANDS.items())
    return (
        "usage: distrain COMMAND [options]\n\n"
        "Train transformer models across processes and machines on torch.distributed.\n\n"
        f"commands:\n{rows}\n\n"
        "options:\n"
        "  -h, --help  show this help and exit\n"
        "  --version   print the version and exit\n\n"
        "`distrain COMMAND --help` shows a command's options; `distrain train --help-config` "
        "the\nconfig fields."
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(top_help())
        return 0
    if argv[0] == "--version":
        print(f"distrain {version()}")
        return 0
    if argv[0] not in COMMANDS:
        close = difflib.get_close_matches(argv[0], COMMANDS, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        what = "option" if argv[0].startswith("-") else "command"
        print(
            f"distrain: error: unknown {what} {argv[0]!r}; {hint}commands: {', '.join(COMMANDS)}",
            file=sys.stderr,
        )
        return 2
    try:
        COMMANDS[argv[0]].run(argv[1:])
    except DistrainError as e:
        print(f"distrain: {e.label}: {e}", file=sys.stderr)
        return e.exit_code
    return 0


def program() -> NoReturn:
    """The `distrain` program (its console script and `python -m distrain`): `main` on the
    command line, then the process's exit; after a `quick_exit` command the objects alive are
    frozen (gc.freeze), so the interpreter's last collection skips them."""
    argv = sys.argv[1:]
    code = main(argv)
    command = COMMANDS.get(argv[0]) if argv else None
    if command is not None and command.quick_exit:
        gc.freeze()
    sys.exit(code)


if __name__ == "__main__":
    program()
