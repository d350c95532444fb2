"""Time from a stop signal to exit with a committed `preempt` checkpoint.

Each run is a real `distrain train --nproc 2` (CPU, gloo) that gets SIGTERM at its launcher from
this script once step 3 is logged, as a scheduler would send it. torchrun's agent forwards the
signal to the workers; they agree on a stop step (one step after the first rank saw it), save a
checkpoint of kind `preempt`, commit it and exit 75.

Milestones, from clocks on this machine:
- signal: just before os.kill of the launcher;
- committed: the `time` field of the preempt checkpoint's MANIFEST.json (written by rank 0 at
  commit);
- exit: the launcher's exit, seen by waitpid here.
It also reports the save's own duration (rank 0's "written in X s" log line), the steps run after
the signal, the median step time and the checkpoint's size.

Run from the repository root:

    python3 benchmarks/preempt.py                         # tiny and small, 3 runs each
    python3 benchmarks/preempt.py --presets small --runs 5

It prints a table (the median per preset) and writes JSON to --out
(default benchmarks/results/preempt.json).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from harness import write_json

NUM_RANKS = 2
SIGNAL_AFTER_STEP = 3
EXIT_PREEMPTED = 75
POLL_S = 0.005


def logged_steps(metrics: Path) -> list[dict]:
    if not metrics.exists():
        return []
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return [r for r in rows if "loss" in r]


def one_run(run_dir: Path, *, preset: str, timeout_s: float) -> dict[str, float]:
    fields = {
        "run.dir": str(run_dir),
        "model.preset": preset,
        "data.max_bytes": "4000000",
        "training.steps": "1000",
        "training.global_batch_size": "8",
        "training.micro_batch_size": "2",
        "training.seq_len": "64",
        "training.log_interval_steps": "1",
        "training.eval_interval_steps": "0",
        "checkpoint.interval_steps": "0",
        "checkpoint.at_end": "false",
        "metrics.progress_bar": "false",
        "metrics.tensorboard": "false",
    }
    args = [sys.executable, "-m", "distrain", "train", "--nproc", str(NUM_RANKS)]
    for key, value in fields.items():
        args += [f"--{key}", value]
    proc = subprocess.Popen(
        args,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + timeout_s
    try:
        while len(logged_steps(metrics)) < SIGNAL_AFTER_STEP:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"training ended early:\n{proc.communicate()[1][-3000:]}")
            time.sleep(POLL_S)
        step_at_signal = logged_steps(metrics)[-1]["step"]
        sent = time.time()
        os.kill(proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=timeout_s)
        exited = time.time()
    finally:
        proc.kill()
    if proc.returncode != EXIT_PREEMPTED:
        raise RuntimeError(f"exit {proc.returncode}, not {EXIT_PREEMPTED}:\n{err[-3000:]}")
    step_dirs = sorted((run_dir / "checkpoints").glob("step-*"))
    manifest = json.loads((step_dirs[-1] / "MANIFEST.json").read_text())
    assert manifest["kind"] == "preempt", manifest
    log = (run_dir / "logs" / "rank0.log").read_text()
    written = re.search(r"\(preempt\) written in ([\d.]+)s", log)
    steps = logged_steps(metrics)
    return {
        "signal_to_committed_s": manifest["time"] - sent,
        "signal_to_exit_s": exited - sent,
        "save_s": float(written[1]) if written else float("nan"),
        "steps_after_signal": manifest["step"] - step_at_signal,
        "step_s": statistics.median(r["step_time_s"] for r in steps[1:]),
        "checkpoint_mb": sum(f["size"] for f in manifest["files"].values()) / 2**20,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--presets", nargs="+", default=["tiny", "small"])
    parser.add_argument("--runs", type=int, default=3, help="Runs per preset (median taken).")
    parser.add_argument("--timeout-s", type=float, default=300, help="Limit for one run.")
    parser.add_argument("--out", default="benchmarks/results/preempt.json")
    ns = parser.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="distrain-preempt-"))
    results = {}
    try:
        for preset in ns.presets:
            runs = [
                one_run(tmp / f"{preset}-{i}", preset=preset, timeout_s=ns.timeout_s)
                for i in range(ns.runs)
            ]
            median = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
            results[preset] = {"runs": runs, "median": median}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    columns = list(next(iter(results.values()))["median"])
    print(f"{'preset':<8}" + "".join(f"{c:>23}" for c in columns))
    for preset, result in results.items():
        print(f"{preset:<8}" + "".join(f"{result['median'][c]:>23.3f}" for c in columns))

    write_json(
        ns.out,
        {
            "config": {
                "ranks": NUM_RANKS,
                "signal": "SIGTERM to the launcher",
                "signal_after_step": SIGNAL_AFTER_STEP,
                "global_batch_size": 8,
                "micro_batch_size": 2,
                "seq_len": 64,
                "backend": "gloo",
                "launch": "distrain train --nproc 2 (standalone)",
                "torch": torch.__version__,
                "cpus": os.cpu_count(),
            },
            "presets": results,
        },
    )


if __name__ == "__main__":
    main()
