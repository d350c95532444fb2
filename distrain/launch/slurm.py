"""Slurm: the sbatch script `distrain slurm` writes and submits, and the environment contract of
`distrain train` started by `srun` with one task per process.

The batch script runs one `distrain train` launcher (torchrun's agent) per node through `srun`,
with a c10d rendezvous on the allocation's first node and `--nnodes` taken from the allocation,
so a job given MIN-MAX nodes runs on whatever it got. Slurm sends the batch shell SIGUSR1
`checkpoint.preempt_grace_s` before the time limit (`--signal=B:USR1@<grace>`); the script passes
it to srun, which forwards it to the launchers, which stop the run with a preempt checkpoint
(exit 75, see preempt.py). On exit 75 a `--requeue` job puts itself back in the queue
(`scontrol requeue`) and its next start resumes from the same run dir.

User strings (the run dir, the train options, the python command) enter the script as
single-quoted bash words, on one line (`bash_word`), never inside double quotes or comments, so
nothing in them is run or starts a line; the #SBATCH options (--partition, --account, --time,
--qos, --constraint and the words of each --sbatch line) are refused when they hold control
characters, and each stands in its directive as one shell-quoted word.

The script runs `python3` as found on PATH when the job starts (sbatch passes the submitting
shell's environment, an activated virtual environment included), or the `--python` given.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from distrain.errors import ConfigError, DistrainError
from distrain.files import write_atomic

SCRIPT_NAME = "slurm.sbatch"
# Options the script sets for each node's launcher from the allocation.
SCRIPT_LAUNCH_OPTIONS = ("--nnodes", "--node-rank", "--rdzv-endpoint", "--rdzv-id")
# MASTER_PORT of a job that runs one task per process, when the user sets none: the same on every
# task of a step and different between steps of a job (a step's port is free again once it ends).
SRUN_PORT_BASE, SRUN_PORT_SPAN = 20000, 20000
CONTROL_CHARACTER = re.compile(r"[\x00-\x1f\x7f]")
# sbatch options the script sets itself or takes from a `distrain slurm` option: an --sbatch
# line naming one is refused with the option to use (long and short forms).
MANAGED_SBATCH = {
    "--nodes": "--nodes",
    "-N": "--nodes",
    "--ntasks-per-node": "nothing: one launcher per node is how the script works",
    "--signal": "--checkpoint.preempt_grace_s in the train options",
    "--requeue": "--requeue",
    "--no-requeue": "--requeue (or leave it out)",
    "--gres": "--gpus-per-node",
    "--partition": "--partition",
    "-p": "--partition",
    "--time": "--time",
    "-t": "--time",
    "--account": "--account",
    "-A": "--account",
    "--qos": "--qos",
    "-q": "--qos",
    "--constraint": "--constraint",
    "-C": "--constraint",
    "--cpus-per-task": "--cpus-per-task",
    "-c": "--cpus-per-task",
    "--exclusive": "--exclusive",
}
# Directives the script sets by default that an --sbatch line may replace.
REPLACEABLE_SBATCH = {"--job-name": "-J", "--output": "-o", "--open-mode": None}


@dataclass(frozen=True, kw_only=True)
class SlurmJob:
    """What `distrain slurm` asks Slurm for, and the training it runs."""

    min_nodes: int
    max_nodes: int
    gpus_per_node: int = 0
    partition: str | None = None
    time: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    cpus_per_task: int | None = None
    exclusive: bool = False
    sbatch_lines: tuple[str, ...] = ()
    """Further sbatch options, one `#SBATCH` line each (`--mail-type=END`, `--mem 0`)."""
    requeue: bool = False
    grace_s: int
    run_dir: Path
    python: str = "python3"
    train_argv: list[str]
    job_name: str = "distrain"


def _option_name(word: str) -> str:
    """`--qos=high` -> `--qos`; `-pgpu` -> `-p`."""
    if word.startswith("--"):
        return word.split("=", 1)[0]
    return word[:2]


def sbatch_line_words(line: str) -> list[str]:
    """An --sbatch line as sbatch option words, checked: one line, starting with an option that
    neither the script nor another `distrain slurm` option sets."""
    if CONTROL_CHARACTER.search(line):
        raise ConfigError(
            f"--sbatch: control characters (newline, tab...) are not allowed, got {line!r}"
        )
    try:
        words = shlex.split(line)
    except ValueError as e:
        raise ConfigError(f"--sbatch {line!r}: {e}") from None
    if not words or not words[0].startswith("-"):
        raise ConfigError(f"--sbatch {line!r}: expected an sbatch option, e.g. --qos=high")
    name = _option_name(words[0])
    if name in MANAGED_SBATCH:
        raise ConfigError(
            f"--sbatch {line!r}: `distrain slurm` sets {name}; use {MANAGED_SBATCH[name]}"
        )
    return words


def parse_nodes(text: str) -> tuple[int, int]:
    """`N` or `MIN-MAX` (sbatch's form) -> (min, max) with 1 <= min <= max."""
    match = re.fullmatch(r"(\d+)(?:-(\d+))?", text.strip())
    if not match:
        raise ConfigError(f"--nodes: expected N or MIN-MAX (integers), got {text!r}")
    low = int(match[1])
    high = int(match[2]) if match[2] else low
    if not 1 <= low <= high:
        raise ConfigError(f"--nodes {text}: need 1 <= MIN <= MAX")
    return low, high


def parse_time_s(text: str) -> int:
    """A Slurm time limit (M, M:S, H:M:S, D-H, D-H:M, D-H:M:S) in seconds."""
    match = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", text.strip())
    if not match:
        raise ConfigError(
            f"--time: expected a Slurm time limit (MIN, MIN:SEC, H:MIN:SEC, D-H, D-H:MIN or "
            f"D-H:MIN:SEC), got {text!r}"
        )
    days, first, second, third = match.groups()
    parts = [int(p) for p in (first, second, third) if p is not None]
    if days is not None:  # D-H[:M[:S]]
        hours, minutes, seconds = (parts + [0, 0])[:3]
        return ((int(days) * 24 + hours) * 60 + minutes) * 60 + seconds
    if len(parts) == 1:
        return parts[0] * 60
    if len(parts) == 2:
        return parts[0] * 60 + parts[1]
    return (parts[0] * 60 + parts[1]) * 60 + parts[2]


def check_job(job: SlurmJob) -> None:
    """Every error is one line naming the option."""
    for name, value in (
        ("partition", job.partition),
        ("account", job.account),
        ("time", job.time),
        ("qos", job.qos),
        ("constraint", job.constraint),
    ):
        if value is not None and CONTROL_CHARACTER.search(value):
            # A newline would end the #SBATCH line and start a script line of its own.
            raise ConfigError(
                f"--{name}: control characters (newline, tab...) are not allowed, got {value!r}"
            )
    if job.gpus_per_node < 0:
        raise ConfigError(f"--gpus-per-node must be >= 0, got {job.gpus_per_node}")
    if job.cpus_per_task is not None and job.cpus_per_task < 1:
        raise ConfigError(f"--cpus-per-task must be >= 1, got {job.cpus_per_task}")
    if not job.python.strip():
        raise ConfigError("--python: give the python command of the job, e.g. python3")
    names = [_option_name(sbatch_line_words(line)[0]) for line in job.sbatch_lines]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ConfigError(f"--sbatch: {', '.join(repeated)} given more than once; keep one")
    if job.time is not None and parse_time_s(job.time) <= job.grace_s:
        raise ConfigError(
            f"--time {job.time} is not longer than checkpoint.preempt_grace_s "
            f"({job.grace_s} s), the warning Slurm gives before the limit: ask for more time or "
            "lower the grace period"
        )
    given = [
        a.split("=", 1)[0] for a in job.train_argv if a.split("=", 1)[0] in SCRIPT_LAUNCH_OPTIONS
    ]
    if given:
        raise ConfigError(
            f"{', '.join(given)}: `distrain slurm` sets these from the allocation; drop them "
            "from the train options (use --nodes for the node count)"
        )
    rewinds = [
        a
        for a, value in zip(job.train_argv, [*job.train_argv[1:], ""], strict=False)
        if (a == "--resume-from" and value.isdigit())
        or (a.startswith("--resume-from=") and a.split("=", 1)[1].isdigit())
    ]
    if rewinds:
        raise ConfigError(
            "--resume-from STEP: not in a job's train options (a requeued job would delete its "
            "newer checkpoints again); run `distrain train --resume-from STEP` once, or give "
            "--resume-from PATH"
        )


def bash_word(text: str) -> str:
    """`text` as one bash word on one line: shlex's quoting, or $'...' (ANSI-C quoting) when it
    holds control characters, whose newlines would otherwise stand in the script as lines of
    their own (and read as #SBATCH directives by a line-oriented reader)."""
    if not CONTROL_CHARACTER.search(text):
        return shlex.quote(text)
    return "$'" + "".join(_ansi_c_char(c) for c in text) + "'"


def _ansi_c_char(char: str) -> str:
    if char in "\\'":
        return "\\" + char
    return f"\\x{ord(char):02x}" if CONTROL_CHARACTER.match(char) else char


def _train_argv(job: SlurmJob) -> list[str]:
    """The train options without any run dir of theirs: the script gives `job.run_dir` once."""
    out, skip = [], False
    for arg in job.train_argv:
        name = arg.split("=", 1)[0]
        if skip:
            skip = False
        elif arg in ("--run-dir", "--run.dir"):
            skip = True
        elif name not in ("--run-dir", "--run.dir"):
            out.append(arg)
    return out


def sbatch_script(job: SlurmJob) -> str:
    """The batch script: sbatch directives, then one launcher per node and the signal path."""
    from distrain.launch.preempt import EXIT_PREEMPTED

    check_job(job)
    nodes = (
        str(job.min_nodes) if job.min_nodes == job.max_nodes else f"{job.min_nodes}-{job.max_nodes}"
    )
    extra = [sbatch_line_words(line) for line in job.sbatch_lines]
    replaced = {_option_name(words[0]) for words in extra}
    replaced |= {long for long, short in REPLACEABLE_SBATCH.items() if short in replaced}
    directives = [
        [f"--job-name={job.job_name}"],
        [f"--nodes={nodes}"],
        ["--ntasks-per-node=1"],
        [f"--signal=B:USR1@{job.grace_s}"],
        ["--requeue" if job.requeue else "--no-requeue"],
        # A requeued job appends to its output instead of replacing the first attempt's.
        ["--open-mode=append"],
        ["--output=slurm-%j.out"],
    ]
    directives = [d for d in directives if _option_name(d[0]) not in replaced]
    if job.gpus_per_node:
        directives.append([f"--gres=gpu:{job.gpus_per_node}"])
    for name, value in (
        ("partition", job.partition),
        ("time", job.time),
        ("account", job.account),
        ("qos", job.qos),
        ("constraint", job.constraint),
        ("cpus-per-task", job.cpus_per_task),
    ):
        if value is not None:
            directives.append([f"--{name}={value}"])
    if job.exclusive:
        directives.append(["--exclusive"])
    directives += extra
    train = [job.python, "-m", "distrain", "train"]
    train_argv = _train_argv(job)
    if job.gpus_per_node and not any(a.split("=", 1)[0] == "--nproc" for a in train_argv):
        train += ["--nproc", str(job.gpus_per_node)]
    train += [*train_argv, "--run-dir", str(job.run_dir)]
    run_dir = bash_word(str(job.run_dir))
    # The run dir reaches bash only as the one quoted word assigned to $run_dir; the lines
    # below expand the variable (never re-read as code) and %q prints a command to paste back.
    after_preempt = (
        '    echo "distrain: preempted with a checkpoint; requeueing job $SLURM_JOB_ID"\n'
        '    scontrol requeue "$SLURM_JOB_ID"\n'
        if job.requeue
        else "    printf 'distrain: preempted with a checkpoint; resume with: sbatch %q\\n' "
        f'"$run_dir/{SCRIPT_NAME}"\n'
    )
    python = bash_word(job.python)
    return (
        "#!/bin/bash\n"
        # No user string in a comment: a newline in it would start a line of its own.
        "# Written by `distrain slurm` for the run dir set below; submit again with sbatch.\n"
        + "".join(f"#SBATCH {' '.join(shlex.quote(w) for w in d)}\n" for d in directives)
        + "set -u\n"
        f"run_dir={run_dir}\n"
        'echo "distrain: job $SLURM_JOB_ID (start ${SLURM_RESTART_COUNT:-0}) on '
        '$SLURM_JOB_NUM_NODES node(s): $SLURM_JOB_NODELIST"\n'
        'echo "distrain: run dir $run_dir: per-rank logs in $run_dir/logs/rank<N>.log, metrics '
        'in $run_dir/metrics.jsonl"\n'
        "# The rendezvous store runs on the first node (where this script runs), at the address\n"
        "# Slurm itself uses for that node, on a port free there now.\n"
        'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)\n'
        "head_addr=$(scontrol show node \"$head\" | sed -n 's/.*NodeAddr=\\([^ ]*\\).*/\\1/p')\n"
        f'port=$({python} -c \'import socket; s = socket.socket(); s.bind(("", 0)); '
        "print(s.getsockname()[1])')\n"
        "# One launcher per node; each adds its node rank (node 0 hosts the store).\n"
        "srun --ntasks-per-node=1 --kill-on-bad-exit=1 \\\n"
        '    bash -c \'exec "$@" --node-rank "$SLURM_NODEID"\' distrain \\\n'
        f"    {' '.join(bash_word(word) for word in train)} \\\n"
        '    --nnodes "$SLURM_JOB_NUM_NODES" --rdzv-endpoint "$head_addr:$port" \\\n'
        '    --rdzv-id "slurm-$SLURM_JOB_ID-${SLURM_RESTART_COUNT:-0}" &\n'
        "srun_pid=$!\n"
        "# Slurm's warning (--signal=B:USR1) or a SIGTERM reach this shell only: srun forwards\n"
        "# SIGUSR1 to every launcher, which stop the run with a preempt checkpoint.\n"
        "stop() {\n"
        '    echo "distrain: $1: stopping with a checkpoint"\n'
        '    kill -USR1 "$srun_pid" 2>/dev/null\n'
        "}\n"
        "trap 'stop SIGUSR1' USR1\n"
        "trap 'stop SIGTERM' TERM\n"
        "rc=0\n"
        'wait "$srun_pid" || rc=$?\n'
        "# A trapped signal ends `wait` early; wait again until srun itself is gone.\n"
        'while kill -0 "$srun_pid" 2>/dev/null; do\n'
        '    rc=0\n    wait "$srun_pid" || rc=$?\n'
        "done\n"
        f'if [ "$rc" -eq {EXIT_PREEMPTED} ]; then\n'
        f"{after_preempt}"
        "fi\n"
        'exit "$rc"\n'
    )


def write_script(job: SlurmJob) -> Path:
    path = job.run_dir / SCRIPT_NAME
    job.run_dir.mkdir(parents=True, exist_ok=True)
    # A fresh file renamed over the name (a link planted there is replaced, not followed),
    # executable from its creation: no chmod by name, which would follow a link put back.
    write_atomic(path, sbatch_script(job), mode=0o755)
    return path


def submit(script: Path) -> str:
    """`sbatch script`; returns the job id."""
    try:
        result = subprocess.run(
            ["sbatch", "--parsable", str(script)], capture_output=True, text=True, timeout=120
        )
    except FileNotFoundError:
        raise DistrainError(
            f"sbatch not found: run on a Slurm login node, or see the script with --dry-run "
            f"({script})"
        ) from None
    if result.returncode != 0:
        reason = (result.stderr.strip().splitlines() or ["no message"])[-1]
        raise DistrainError(f"sbatch {script} failed: {reason}")
    return result.stdout.strip().split(";")[0]


def slurm_parser() -> argparse.ArgumentParser:
    from distrain.config.args import CommandParser

    parser = CommandParser(
        prog="distrain slurm",
        usage="distrain slurm [options] -- [train options]",
        description="Write an sbatch script for a training run into its run dir and submit it: "
        "one launcher per node, a rendezvous on the first node, SIGUSR1 "
        "checkpoint.preempt_grace_s before the time limit (the run stops with a checkpoint), "
        "and with --requeue the job requeues itself and resumes. The run dir must be on a "
        "filesystem every node shares. `distrain slurm --dry-run -- ...` prints the script.",
    )
    parser.add_argument("--nodes", default="1", metavar="N|MIN-MAX", help="Nodes to ask for.")
    parser.add_argument(
        "--gpus-per-node",
        type=int,
        default=0,
        metavar="G",
        help="GPUs per node (--gres=gpu:G) and workers per node; 0 = a CPU-only job.",
    )
    parser.add_argument("--partition", metavar="P", help="Partition (default: the cluster's).")
    parser.add_argument(
        "--time", metavar="T", help="Time limit, in sbatch's format (default: the partition's)."
    )
    parser.add_argument("--account", metavar="A", help="Account to charge (default: yours).")
    parser.add_argument("--qos", metavar="Q", help="Quality of service (default: the account's).")
    parser.add_argument(
        "--constraint", metavar="C", help="Node features required, e.g. h100 (default: none)."
    )
    parser.add_argument(
        "--cpus-per-task",
        type=int,
        metavar="N",
        help="CPUs for each node's launcher and its workers (default: the cluster's).",
    )
    parser.add_argument(
        "--exclusive", action="store_true", help="Ask for whole nodes, shared with no other job."
    )
    parser.add_argument(
        "--sbatch",
        action="append",
        default=[],
        metavar="LINE",
        help="A further #SBATCH line, e.g. --sbatch=--mail-type=END or --sbatch '--mem 0' "
        "(repeatable; --job-name and --output replace the script's).",
    )
    parser.add_argument(
        "--python",
        default="python3",
        help="The Python that runs distrain in the job, found on the job's PATH when it starts "
        "(sbatch passes the submitting shell's environment, an active venv included).",
    )
    parser.add_argument(
        "--requeue",
        action="store_true",
        help="After a preemption or time-limit stop, requeue the job; it resumes the run.",
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="Print the script; write and submit nothing."
    )
    return parser


def slurm_command(argv: list[str]) -> None:
    """`distrain slurm [options] -- [train options]`."""
    from distrain.config.args import parse_train_args

    split = argv.index("--") if "--" in argv else len(argv)
    ns = slurm_parser().parse_args(argv[:split])
    train_argv = argv[split + 1 :]
    _, cfg = parse_train_args(train_argv, worker=False)
    min_nodes, max_nodes = parse_nodes(ns.nodes)
    job = SlurmJob(
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        gpus_per_node=ns.gpus_per_node,
        partition=ns.partition,
        time=ns.time,
        account=ns.account,
        qos=ns.qos,
        constraint=ns.constraint,
        cpus_per_task=ns.cpus_per_task,
        exclusive=ns.exclusive,
        sbatch_lines=tuple(ns.sbatch),
        requeue=ns.requeue,
        grace_s=cfg.checkpoint.preempt_grace_s,
        run_dir=Path(cfg.run.dir).absolute(),
        python=ns.python,
        train_argv=train_argv,
    )
    if ns.dry_run:
        print(sbatch_script(job), end="")
        return
    script = write_script(job)
    job_id = submit(script)
    print(
        f"distrain: submitted job {job_id} ({script}); output in slurm-{job_id}.out, "
        f"per-rank logs in {job.run_dir}/logs/"
    )


# --- `distrain train` as one srun task per process ---------------------------------------------


def under_srun() -> bool:
    """Inside a job step started by srun (not merely inside an allocation)."""
    return "SLURM_STEP_ID" in os.environ and "SLURM_PROCID" in os.environ


def first_host(nodelist: str) -> str:
    """The first host of a Slurm hostlist ("gpu[03-05,9],cpu1" -> "gpu03")."""
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?([^,]*)", nodelist.strip())
    if not match:
        raise DistrainError(f"cannot read the Slurm node list {nodelist!r}; set MASTER_ADDR")
    prefix, ranges, suffix = match.groups()
    if ranges is None:
        return prefix + suffix
    first = ranges.split(",")[0].split("-")[0]
    return f"{prefix}{first}{suffix}"


def _tasks_per_node(text: str) -> list[int]:
    """SLURM_STEP_TASKS_PER_NODE ("2(x3),1") expanded to one count per node."""
    counts = []
    for part in text.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not match:
            return []
        counts += [int(match[1])] * int(match[2] or 1)
    return counts


def srun_task_env(environ: Mapping[str, str]) -> dict[str, str]:
    """torch.distributed's env contract (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT) from an srun task's SLURM_* variables. A MASTER_ADDR or
    MASTER_PORT already set wins (for clusters whose node names do not resolve)."""
    try:
        rank = int(environ["SLURM_PROCID"])
        world = int(environ.get("SLURM_STEP_NUM_TASKS") or environ["SLURM_NTASKS"])
        local_rank = int(environ.get("SLURM_LOCALID", 0))
        job_id = int(environ.get("SLURM_JOB_ID", 0))
        step_id = int(environ.get("SLURM_STEP_ID", 0))
    except (KeyError, ValueError) as e:
        raise DistrainError(f"srun task without a usable SLURM_* environment ({e})") from None
    nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST", "")
    per_node = _tasks_per_node(environ.get("SLURM_STEP_TASKS_PER_NODE", ""))
    node = int(environ.get("SLURM_NODEID", 0))
    local_world = per_node[node] if node < len(per_node) else world
    port = SRUN_PORT_BASE + (job_id * 64 + step_id) % SRUN_PORT_SPAN
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(local_world),
        "MASTER_ADDR": environ.get("MASTER_ADDR") or first_host(nodelist or "localhost"),
        "MASTER_PORT": environ.get("MASTER_PORT") or str(port),
    }
