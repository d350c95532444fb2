"""Gradient communication methods side by side: bytes, step time on loopback and on shaped links,
and loss after a fixed budget.

For each method (DDP hooks none, fp16, bf16, powersgd, onebit; and the onebit_adam optimizer with
a small freeze step, under plain DDP, ZeRO-1 and ZeRO-2: `onebit_adam_zero1`, `onebit_adam_zero2`)
the same training run (preset "small" by default, 10.8M parameters, 2 ranks, one process per rank,
OMP_NUM_THREADS=1 each) is launched through `distrain train`:

- on loopback: `--nproc 2` standalone on this machine;
- on each shaped link (`--rates`): a 2-host network lab (tests/netlab.py: two network namespaces
  joined by a veth pair whose egress is limited by tc tbf to the rate), one torchrun agent per
  host (`--nnodes 2 --nproc 1`, rendezvous on host 0's lab address).

From metrics.jsonl (one row per step): bytes per step is what this rank sends over the network
(`comm_bytes`, compress.wire_bytes of each collective) and `comm_compression_ratio` its ratio to a
plain fp32 all-reduce of the same gradients, both taken after the first SKIP steps (DDP's bucket
rebuild, PowerSGD's start and 1-bit Adam's freeze are all within them). Step time is the median
`step_time_s` over the steps after SKIP; on each link it is also given as a ratio to `none` on the
same link. Final loss is the training loss at the last step (every method sees the same data);
progress is the share of `none`'s loss decrease (first step to the mean of the last 4) a method
made.

Overlap: how much of the plain all-reduce's communication is hidden behind backward. The
no-communication baseline is two independent single-rank runs side by side (each `--nproc 1`, the
same micro-batch and model, so the same per-rank work and the same competition for the two cores,
but no collective at all). With T_ddp the `none` run's median step time on a link, T_solo the
baseline's, and C the `none` run's communication in-flight time per step (`comm_inflight_s`: issue
to completion of every bucket's all-reduce, summed), the exposed communication is T_ddp - T_solo
and the hidden fraction is 1 - (T_ddp - T_solo) / C, clipped to [0, 1]. C includes waiting for the
slower rank, and buckets in flight at the same time are each counted in full (on a slow link the
second bucket queues behind the first, so C can exceed the step time): the fraction is an estimate,
an upper one where the link is the bottleneck, not an exact accounting.

Run as root from the repository root (the lab needs network namespaces and tc; without them it
prints why and measures loopback only):

    python3 benchmarks/comm.py      # defaults: ~4 min on 2 idle cores, ~8 when they are busy
    python3 benchmarks/comm.py --methods none,onebit_adam --rates 100mbit --steps 8

Prints the table and writes JSON to --out (default benchmarks/results/comm.json).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from harness import wait_all, write_json  # noqa: E402
from netlab import NetLab, lab_available, net_lab  # noqa: E402

from distrain.observe.metrics import read_metrics  # noqa: E402

NUM_RANKS = 2
SKIP = 3  # steps left out of medians and byte counts; covers every method's warm-up
FREEZE_STEP = 2  # onebit_adam's fp32 warm-up, and PowerSGD's start
PORT = 29400  # rendezvous port inside the lab; each run adds its own offset
RUN_TIMEOUT_S = 900  # a busy shared machine ran 60 steps of preset tiny in more than 300 s
METHODS: dict[str, dict[str, str]] = {
    "none": {},
    "fp16": {"comm.gradient_compression": "fp16"},
    "bf16": {"comm.gradient_compression": "bf16"},
    "powersgd": {
        "comm.gradient_compression": "powersgd",
        "comm.powersgd_start_step": str(FREEZE_STEP),
    },
    "onebit": {"comm.gradient_compression": "onebit"},
    "onebit_adam": {"optim.name": "onebit_adam", "optim.onebit.freeze_step": str(FREEZE_STEP)},
    "onebit_adam_zero1": {
        "optim.name": "onebit_adam",
        "optim.onebit.freeze_step": str(FREEZE_STEP),
        "parallel.zero_stage": "1",
    },
    "onebit_adam_zero2": {
        "optim.name": "onebit_adam",
        "optim.onebit.freeze_step": str(FREEZE_STEP),
        "parallel.zero_stage": "2",
    },
}
PROGRESS_WINDOW = 4  # last steps averaged for the progress column (one step's loss is noisy)
LOOPBACK = "loopback"

Launch = Callable[[list[str], Path], list[subprocess.Popen]]


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps per run")
    parser.add_argument(
        "--rates",
        type=lambda s: [r for r in s.split(",") if r],
        default=["1gbit", "100mbit"],
        help="comma-separated tc rates of the shaped links (empty: loopback only)",
    )
    parser.add_argument(
        "--methods",
        type=lambda s: s.split(","),
        default=list(METHODS),
        help=f"comma-separated, from {','.join(METHODS)}",
    )
    parser.add_argument("--preset", default="small", help="model preset")
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument(
        "--freeze-step",
        type=int,
        default=FREEZE_STEP,
        help="onebit_adam's warm-up steps and PowerSGD's start (at most the skipped steps "
        "when bytes per step should be the compressed phase's only)",
    )
    parser.add_argument(
        "--skip-overlap",
        action="store_true",
        help="skip the single-rank runs that estimate overlap (loss and bytes only)",
    )
    parser.add_argument(
        "--run-timeout-s",
        type=float,
        default=RUN_TIMEOUT_S,
        help="limit on each training run (raise it for long runs on a busy machine)",
    )
    parser.add_argument("--out", default="benchmarks/results/comm.json", help="JSON output")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.methods) - set(METHODS))
    if unknown:
        parser.error(f"unknown methods {unknown}; choose from {','.join(METHODS)}")
    if args.steps <= SKIP:
        parser.error(f"--steps must exceed the {SKIP} warm-up steps")
    return args


def train_args(args: argparse.Namespace, run_dir: Path, ranks: int, method: str) -> list[str]:
    """`distrain train` options (without launch options) for one run of `method`."""
    fields = {
        "run.dir": str(run_dir),
        "run.device": "cpu",
        "model.preset": args.preset,
        "data.max_bytes": "2000000",
        "training.steps": str(args.steps),
        "training.micro_batch_size": str(args.micro_batch_size),
        "training.global_batch_size": str(args.micro_batch_size * ranks),
        "training.seq_len": str(args.seq_len),
        "training.log_interval_steps": "1",
        "training.eval_interval_steps": "0",
        "training.eval_batches": "1",
        "optim.warmup_steps": "2",
        "checkpoint.interval_steps": "0",
        "checkpoint.at_end": "false",
        "metrics.progress_bar": "false",
        "metrics.tensorboard": "false",
        **METHODS[method],
    }
    for key in ("optim.onebit.freeze_step", "comm.powersgd_start_step"):
        if key in fields:
            fields[key] = str(args.freeze_step)
    return [part for key, value in fields.items() for part in (f"--{key}", value)]


def run_env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def summarize(run_dir: Path, freeze_step: int) -> dict[str, Any]:
    """Medians over the steps after SKIP (and after the freeze step), and the last step's
    loss."""
    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]
    steady = [r for r in rows if r["step"] > max(SKIP, freeze_step)]
    summary: dict[str, Any] = {
        "step_time_s": statistics.median(r["step_time_s"] for r in steady),
        "final_loss": rows[-1]["loss"],
        "losses": [r["loss"] for r in rows],
    }
    if "comm_bytes" in steady[0]:
        # comm_inflight_s is timed by hooks only: DDP's plain all-reduce ("none") runs untimed.
        for key in ("comm_bytes", "comm_compression_ratio", "comm_inflight_s"):
            if key in steady[0]:
                summary[key] = statistics.median(r[key] for r in steady)
    return summary


def run_loopback(args: argparse.Namespace, method: str, work: Path) -> dict[str, Any]:
    run_dir = work / f"{LOOPBACK}-{method}"
    log = work / f"{LOOPBACK}-{method}.log"
    argv = [sys.executable, "-m", "distrain", "train", "--nproc", str(NUM_RANKS)]
    with log.open("w") as out:
        proc = subprocess.Popen(
            argv + train_args(args, run_dir, NUM_RANKS, method),
            stdout=out,
            stderr=subprocess.STDOUT,
            env=run_env(),
        )
        wait_all([proc], log, timeout_s=args.run_timeout_s)
    return summarize(run_dir, args.freeze_step)


def run_solo_pair(args: argparse.Namespace, work: Path) -> float:
    """Two independent single-rank `none` runs side by side; their mean median step time."""
    procs, dirs = [], []
    log = work / "solo.log"
    with log.open("w") as out:
        for i in range(NUM_RANKS):
            run_dir = work / f"solo{i}"
            dirs.append(run_dir)
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "distrain", "train", "--nproc", "1"]
                    + train_args(args, run_dir, 1, "none"),
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=run_env(),
                )
            )
        wait_all(procs, log, timeout_s=args.run_timeout_s)
    return statistics.mean(summarize(d, args.freeze_step)["step_time_s"] for d in dirs)


def run_lab(
    args: argparse.Namespace, lab: NetLab, rate: str, method: str, work: Path, port: int
) -> dict[str, Any]:
    run_dir = work / f"{rate}-{method}"
    log = work / f"{rate}-{method}.log"
    endpoint = f"{lab.hosts[0].addr}:{port}"
    with log.open("w") as out:
        procs = [
            lab.run(
                node,
                [sys.executable, "-m", "distrain", "train", "--nnodes", str(NUM_RANKS)]
                + ["--nproc", "1", "--node-rank", str(node), "--rdzv-endpoint", endpoint]
                + ["--rdzv-id", f"{rate}-{method}"]
                + train_args(args, run_dir, NUM_RANKS, method),
                env={"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"},
                stdout=out,
                stderr=subprocess.STDOUT,
            )
            for node in range(NUM_RANKS)
        ]
        wait_all(procs, log, timeout_s=args.run_timeout_s)
    return summarize(run_dir, args.freeze_step)


def progress(losses: list[float], reference: list[float]) -> float:
    """The share of the reference run's loss decrease that `losses` made."""

    def decrease(values: list[float]) -> float:
        return values[0] - statistics.mean(values[-PROGRESS_WINDOW:])

    return decrease(losses) / decrease(reference)


def hidden_fraction(ddp: dict[str, Any], solo_step_s: float) -> float:
    exposed = max(ddp["step_time_s"] - solo_step_s, 0.0)
    return min(max(1 - exposed / ddp["comm_inflight_s"], 0.0), 1.0)


def report(
    args: argparse.Namespace,
    links: list[str],
    results: dict[str, dict[str, dict[str, Any]]],
    solo_step_s: float,
    lab_reason: str | None,
    load: tuple[float, float],
) -> None:
    """Print the table and write the JSON."""
    print(
        f"\ngradient communication: preset {args.preset}, {NUM_RANKS} ranks x 1 process (gloo, "
        f"CPU, OMP_NUM_THREADS=1), micro-batch {args.micro_batch_size} x {args.seq_len}, "
        f"{args.steps} steps, medians over steps > {SKIP}; step time as ms (x none on that link)"
    )
    print(f"1-minute load average at start / end: {load[0]:.2f} / {load[1]:.2f} (2 cores)")
    if lab_reason is not None:
        print(f"network lab unavailable, loopback only: {lab_reason}")
    header = f"{'method':<12}{'MB/step':>9}{'x fp32':>8}" + "".join(
        f"{link + ' ms':>20}" for link in links
    )
    header += f"{'final loss':>12}{'progress':>10}"
    print(header)
    print("-" * len(header))
    for method in args.methods:
        by_link = results[method]
        first = by_link[LOOPBACK]
        line = f"{method:<12}{first['comm_bytes'] / 1e6:>9.3f}"
        line += f"{first['comm_compression_ratio']:>7.1f}x"
        for link in links:
            step_s = by_link[link]["step_time_s"]
            ratio = step_s / results["none"][link]["step_time_s"] if "none" in results else 1.0
            line += f"{step_s * 1e3:>12.0f} ({ratio:4.2f}x)"
        line += f"{first['final_loss']:>12.4f}"
        if "none" in results:
            first["progress"] = progress(first["losses"], results["none"][LOOPBACK]["losses"])
            line += f"{first['progress']:>10.3f}"
        print(line)
    overlap: dict[str, float] = {}
    timed = "none" in results and all("comm_inflight_s" in results["none"][link] for link in links)
    if timed and solo_step_s > 0:
        overlap = {link: hidden_fraction(results["none"][link], solo_step_s) for link in links}
        print(
            f"overlap (none vs 2 side-by-side single-rank runs, {solo_step_s * 1e3:.0f} ms/step): "
            + ", ".join(f"{link} {frac:.0%} of comm hidden" for link, frac in overlap.items())
        )
    elif "none" in results:
        print("overlap: not estimated (DDP's plain all-reduce is counted, not timed)")
    result = {
        "config": {
            "preset": args.preset,
            "num_ranks": NUM_RANKS,
            "backend": "gloo",
            "steps": args.steps,
            "skip_steps": SKIP,
            "freeze_step": args.freeze_step,
            "micro_batch_size": args.micro_batch_size,
            "seq_len": args.seq_len,
            "links": links,
            "lab_unavailable_reason": lab_reason,
            "torch": torch.__version__,
            "load_average_start_end": load,
        },
        "results": results,
        "solo_step_s": solo_step_s,
        "hidden_fraction": overlap,
    }
    write_json(args.out, result)


def main() -> None:
    args = parse_args(sys.argv[1:])
    lab_reason = lab_available() if args.rates else None
    rates = args.rates if lab_reason is None else []
    work = Path(tempfile.mkdtemp(prefix="distrain-comm-"))
    load_start = os.getloadavg()[0]
    results: dict[str, dict[str, dict[str, Any]]] = {m: {} for m in args.methods}
    try:
        overlap = "none" in args.methods and not args.skip_overlap
        solo_step_s = run_solo_pair(args, work) if overlap else 0.0
        for method in args.methods:
            results[method][LOOPBACK] = run_loopback(args, method, work)
            print(f"{LOOPBACK} {method}: {results[method][LOOPBACK]['step_time_s']:.3f} s/step")
        for rate in rates:
            with net_lab(NUM_RANKS, rate=rate) as lab:
                for offset, method in enumerate(args.methods):
                    results[method][rate] = run_lab(args, lab, rate, method, work, PORT + offset)
                    print(f"{rate} {method}: {results[method][rate]['step_time_s']:.3f} s/step")
        report(
            args,
            [LOOPBACK, *rates],
            results,
            solo_step_s,
            lab_reason,
            (load_start, os.getloadavg()[0]),
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
