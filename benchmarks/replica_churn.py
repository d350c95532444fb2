"""Membership changes of replica groups when nothing fails: a run of R groups of 1 rank each
(`distrain train --nproc 1` per group, ZeRO-3, the `tiny` preset, one CPU thread per group)
around a lighthouse started with `distrain lighthouse`, with no fault injected, on a machine
optionally loaded with busy processes beside it. Every `replica_change` row any group writes is
a change a fault did not cause: a live group evicted ("lost"), a step every group redid
("retried"), a group that came later than the others ("joined", "rejoined": a transfer of the
live state).

Each lighthouse setting (`--settings`, JOIN_S:HEARTBEAT_MS pairs) gets the same run, the settings
alternating run by run so that they see the same load. `0.1:3000` is the short join timeout
torchft's own tests use; the defaults of `distrain lighthouse` are 30 s and 5000 ms.

Run from the repository root:

    python3 benchmarks/replica_churn.py                      # 3 groups, 60 steps, 2 busy processes
    python3 benchmarks/replica_churn.py --runs 2 --busy 0 --settings 30:400

It prints a table (per run, the changes and the median step time of group 0) and writes JSON to
--out (default benchmarks/results/replica_churn.json).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from harness import write_json

DEFAULT_SETTINGS = "0.1:3000,30:5000"


@contextlib.contextmanager
def busy_processes(count: int) -> Iterator[None]:
    """`count` processes spinning on a core each, as other jobs on a shared host would."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def lighthouse(join_s: float, heartbeat_ms: int) -> Iterator[str]:
    """`distrain lighthouse` with these timeouts on a free port; yields its address."""
    server = subprocess.Popen(
        [sys.executable, "-m", "distrain", "lighthouse", "--bind", "[::]:0"]
        + ["--join-timeout-s", str(join_s), "--heartbeat-timeout-ms", str(heartbeat_ms)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        yield server.stdout.readline().strip()
    finally:
        server.terminate()
        server.wait()


def group_fields(root: Path, *, groups: int, steps: int, address: str) -> dict[str, str]:
    secret = root / "run-secret"
    secret.write_text(secrets.token_hex(32))
    secret.chmod(0o600)
    return {
        "data.max_bytes": "4000000",
        "training.steps": str(steps),
        # A multiple of micro-batch x lcm(1..3): any number of live groups splits it.
        "training.global_batch_size": "12",
        "training.micro_batch_size": "2",
        "training.seq_len": "64",
        "training.log_interval_steps": "1",
        "training.eval_interval_steps": "0",
        "parallel.zero_stage": "3",
        "checkpoint.interval_steps": "0",
        "checkpoint.at_end": "false",
        "metrics.progress_bar": "false",
        "metrics.tensorboard": "false",
        "fault_tolerance.replica_groups": str(groups),
        "fault_tolerance.lighthouse": address,
        "fault_tolerance.timeout_s": "30",
        "fault_tolerance.secret_file": str(secret),
    }


def one_run(root: Path, *, groups: int, steps: int, join_s: float, heartbeat_ms: int) -> dict:
    root.mkdir(parents=True)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with lighthouse(join_s, heartbeat_ms) as address:
        fields = group_fields(root, groups=groups, steps=steps, address=address)
        procs = []
        try:
            for group in range(groups):
                args = [sys.executable, "-m", "distrain", "train", "--nproc", "1"]
                args += ["--fault_tolerance.group", str(group)]
                args += ["--run.dir", str(root / f"group{group}")]
                for key, value in fields.items():
                    args += [f"--{key}", value]
                log = open(root / f"group{group}.stderr", "w")  # noqa: SIM115 (closed by exit)
                procs.append(subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=log, env=env))
            for proc in procs:
                proc.wait(timeout=900)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    failed = [g for g, proc in enumerate(procs) if proc.returncode != 0]
    if failed:
        tail = (root / f"group{failed[0]}.stderr").read_text()[-3000:]
        raise RuntimeError(f"group {failed[0]} exited with {procs[failed[0]].returncode}:\n{tail}")
    changes: dict[str, int] = {}
    for group in range(groups):
        for line in (root / f"group{group}" / "metrics.jsonl").read_text().splitlines():
            row = json.loads(line)
            if "replica_change" in row:
                kind = row["replica_change"]
                changes[kind] = changes.get(kind, 0) + 1
    rows0 = [json.loads(line) for line in (root / "group0" / "metrics.jsonl").open()]
    return {
        "changes": sum(changes.values()),
        "by_kind": changes,
        "steady_step_s": statistics.median(r["step_time_s"] for r in rows0 if "step_time_s" in r),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--groups", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--runs", type=int, default=1, help="Runs of each setting.")
    parser.add_argument("--busy", type=int, default=2, help="Busy processes beside the run.")
    parser.add_argument(
        "--settings", default=DEFAULT_SETTINGS, help="Lighthouse JOIN_S:HEARTBEAT_MS pairs."
    )
    parser.add_argument("--out", default="benchmarks/results/replica_churn.json")
    ns = parser.parse_args()
    settings = [
        (float(join), int(beat))
        for join, beat in (pair.split(":") for pair in ns.settings.split(","))
    ]
    tmp = Path(tempfile.mkdtemp(prefix="distrain-churn-"))
    runs: list[dict[str, Any]] = []
    try:
        with busy_processes(ns.busy):
            for i in range(ns.runs):
                for join_s, heartbeat_ms in settings:
                    start = time.perf_counter()
                    result = one_run(
                        tmp / f"run{i}-{join_s}-{heartbeat_ms}",
                        groups=ns.groups,
                        steps=ns.steps,
                        join_s=join_s,
                        heartbeat_ms=heartbeat_ms,
                    )
                    runs.append(
                        {
                            "join_timeout_s": join_s,
                            "heartbeat_timeout_ms": heartbeat_ms,
                            "wall_s": time.perf_counter() - start,
                            **result,
                        }
                    )
                    print(json.dumps(runs[-1]), flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"\n{'join timeout':>14}{'heartbeat timeout':>19}{'changes':>9}  kinds")
    for run in runs:
        kinds = ", ".join(f"{k} {v}" for k, v in sorted(run["by_kind"].items())) or "-"
        print(
            f"{run['join_timeout_s']:>13g}s{run['heartbeat_timeout_ms']:>16d}ms"
            f"{run['changes']:>9d}  {kinds}"
        )
    write_json(
        ns.out,
        {
            "config": {
                "groups": ns.groups,
                "ranks_per_group": 1,
                "steps": ns.steps,
                "busy_processes": ns.busy,
                "preset": "tiny",
                "zero_stage": 3,
                "threads_per_group": 1,
                "torch": torch.__version__,
                "cpus": os.cpu_count(),
            },
            "runs": runs,
        },
    )


if __name__ == "__main__":
    main()
