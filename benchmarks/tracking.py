"""What experiment tracking and in-loop evaluation cost a training step.

One-rank `Trainer`s (built as a worker builds them) of the same model and data in this process,
each in a fresh run directory, every step logged (`training.log_interval_steps = 1`: the most
rows a tracker can get), a validation pass every `--eval-every` steps over the held-out split
and two named sets (`data.eval_sets`: two standard-library source files). Two modes,
interleaved over `--rounds` rounds (the one that goes first alternates):

- off: no tracker;
- mlflow: `metrics.mlflow.tracking_uri` at a real `mlflow server` (SQLite store) that this
  script starts on a free local port (its own CPU is not this process's).

An observer of the benchmark's own times every step from `before_step` to `step_end` (the
step, its metrics row through the observers and the trackers' queue, and the validation pass
when due), in wall time and in this process's CPU time (every thread: the tracker's too). Per
run, over the steps after the first `--skip`: the median wall time of a step without
validation, the CPU seconds per step (all steps), and the median `eval_s` of its validation
passes. Per mode the median over rounds; then MLflow's overhead per step (mlflow / off - 1, in
wall and in CPU time: CPU time is far less moved by other load on the machine) and the share
of training time the validation passes take at that interval: eval_s / (eval_every x step +
eval_s).

    python3 benchmarks/tracking.py         # 3 rounds x 40 steps, tiny, seq_len 128, 1 thread
    python3 benchmarks/tracking.py --rounds 5 --steps 60

Prints a table and writes JSON to --out (default benchmarks/results/tracking.json).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.request
from pathlib import Path

import torch
from harness import trainer_for, worker_session, write_json

from distrain.config.io import load_config, write_toml
from distrain.observe.metrics import read_metrics
from distrain.observe.observer import StepObserver

MODES = ("off", "mlflow")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def mlflow_server(root: Path):
    port = _free_port()
    proc = subprocess.Popen(
        [str(Path(sys.executable).with_name("mlflow")), "server", "--host", "127.0.0.1",
         "--port", str(port), "--workers", "1",
         "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
         "--artifacts-destination", str(root / "artifacts")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(f"{uri}/health", timeout=2):
                    break
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError("mlflow server did not start")
            time.sleep(0.3)
        yield uri
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


class StepClock(StepObserver):
    """Wall and CPU time of each step, before_step to step_end."""

    def __init__(self) -> None:
        self.steps: dict[int, tuple[float, float]] = {}

    def before_step(self, step: int) -> None:
        self._start = (time.perf_counter(), time.process_time())

    def step_end(self, step: int) -> None:
        wall, cpu = self._start
        self.steps[step] = (time.perf_counter() - wall, time.process_time() - cpu)


def one_run(run_dir: Path, args: argparse.Namespace, tracking_uri: str) -> dict[str, float]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    fields = {
        "run.dir": str(run_dir),
        "run.device": "cpu",
        "model.preset": args.preset,
        "data.max_bytes": "4000000",
        "data.eval_sets": f"textwrap={stdlib / 'textwrap.py'},argparse={stdlib / 'argparse.py'}",
        "training.steps": str(args.steps),
        "training.global_batch_size": "8",
        "training.micro_batch_size": "8",
        "training.seq_len": str(args.seq_len),
        "training.log_interval_steps": "1",
        "training.eval_interval_steps": str(args.eval_every),
        "checkpoint.interval_steps": "0",
        "checkpoint.at_end": "false",
        "metrics.progress_bar": "false",
        "metrics.tensorboard": "false",
        "metrics.mlflow.tracking_uri": tracking_uri,
        "watchdog.hang_timeout_s": "0",
    }
    cfg = load_config(None, list(fields.items()))
    run_dir.mkdir(parents=True)
    write_toml(cfg, run_dir / "config.toml")
    clock = StepClock()
    with worker_session(run_dir) as (ctx, logger):
        trainer = trainer_for(cfg, ctx, logger)
        trainer.observers.insert(0, clock)
        try:
            trainer.run()
        finally:
            trainer.close()
        del trainer
    timed = {s: t for s, t in clock.steps.items() if s > args.skip}
    plain = [wall for s, (wall, _) in timed.items() if s % args.eval_every]
    rows = read_metrics(run_dir / "metrics.jsonl")
    return {
        "step_s": statistics.median(plain),
        "cpu_s_per_step": sum(cpu for _, cpu in timed.values()) / len(timed),
        "eval_s": statistics.median(r["eval_s"] for r in rows if "eval_s" in r),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--skip", type=int, default=5, help="First steps left out of the median.")
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads (1: steadier on a shared machine)"
    )
    parser.add_argument("--out", default="benchmarks/results/tracking.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp, mlflow_server(Path(tmp)) as uri:
        runs: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
        for r in range(args.rounds):
            for mode in MODES if r % 2 == 0 else MODES[::-1]:
                run_dir = Path(tmp) / f"{mode}-{r}"
                runs[mode].append(one_run(run_dir, args, uri if mode == "mlflow" else ""))
    keys = ("step_s", "cpu_s_per_step", "eval_s")
    medians = {
        mode: {key: statistics.median(run[key] for run in runs[mode]) for key in keys}
        for mode in MODES
    }
    off, on = medians["off"], medians["mlflow"]
    overhead_wall = on["step_s"] / off["step_s"] - 1
    overhead_cpu = on["cpu_s_per_step"] / off["cpu_s_per_step"] - 1
    share = off["eval_s"] / (args.eval_every * off["step_s"] + off["eval_s"])
    print(f"{'mode':<8}{'step (ms)':>12}{'CPU/step (ms)':>15}{'eval pass (ms)':>16}")
    for mode in MODES:
        m = medians[mode]
        print(
            f"{mode:<8}{m['step_s'] * 1e3:>12.1f}{m['cpu_s_per_step'] * 1e3:>15.1f}"
            f"{m['eval_s'] * 1e3:>16.1f}"
        )
    print(
        f"MLflow overhead per step: {overhead_wall * 100:+.1f}% wall, {overhead_cpu * 100:+.1f}% "
        "CPU"
    )
    print(
        f"validation (held-out split + 2 named sets, every {args.eval_every} steps): "
        f"{share * 100:.1f}% of training time"
    )
    write_json(
        args.out,
        {
            "config": vars(args),
            "runs": runs,
            "medians": medians,
            "mlflow_overhead_wall": overhead_wall,
            "mlflow_overhead_cpu": overhead_cpu,
            "eval_share_of_time": share,
        },
    )


if __name__ == "__main__":
    main()
