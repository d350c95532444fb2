"""The planner against published training runs (not a test).

For each configuration: the planner's memory per rank (a fake-tensor run of distrain's real build,
distrain/plan/memory.py) and step time (distrain/plan/timing.py) next to the published figures,
and their ratio.

- Llama 3.1 8B, FSDP on 8 H100 (torchtitan docs/performance.md, Table 1: local batch 2, global
  16, sequence 8192, selective activation checkpointing, bf16): 5,762 tokens/s per GPU, 82.4 GiB.
  distrain's GPT has a 2-matrix GELU MLP and full multi-head attention where Llama has SwiGLU and
  grouped-query attention, so the stand-in matches the parameter count (8.0B: dim 4096, 32
  layers, 32 heads, MLP 18432, vocabulary 128256), not every tensor.
- GPT-3 175B on 1,024 A100 with tp 8 x pp 16 x dp 8 (Narayanan et al. 2021, Table 1: global batch
  1536, sequence 2048): 138 TFLOP/s per GPU. The paper gives no memory figure to compare with,
  so only its step time is planned.

With --measure, the planner's step-time model for this machine (distrain/plan/probe.py) against
measured steps of small layouts, and its memory against the same runs: see plan_steps.py.

With --speed, how long `distrain plan` takes cold (no stored calibration: a fresh cache
directory) for the 7B-class presets on 8 nodes x 8 GPUs (the command a user runs before renting
them): wall seconds, CPU seconds (user + system of the command and every process it starts, its
calibration workers included), rows, rows built on fake tensors, and the load average before and
after (the machine's other work slows it), as a table and JSON.

    python3 benchmarks/plan.py [--efficiency 0.45]
    python3 benchmarks/plan.py --measure [--rounds 5 --steps 3]   # this machine, see plan_steps.py
    python3 benchmarks/plan.py --speed [--speed-out plan_speed.json]
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from distrain.config.schema import Config
from distrain.layout.rules import validate
from distrain.plan.memory import estimate_memory
from distrain.plan.planned import planned_run
from distrain.plan.timing import Candidate, Cluster, step_time

GIB = 2**30


def llama3_8b(efficiency: float) -> dict[str, float]:
    cfg = Config()
    m, t = cfg.model, cfg.training
    m.preset, m.vocab_size, m.dim, m.n_layers, m.n_heads = "7b", 128256, 4096, 32, 32
    m.ffn_dim, m.max_seq_len = 18432, 8192
    t.seq_len, t.global_batch_size, t.micro_batch_size = 8192, 16, 2
    t.precision, t.activation_checkpointing, t.ac_every_layers = "bf16", "selective", 2
    cfg.parallel.zero_stage = 3
    mem = estimate_memory(planned_run(cfg, 8))
    cluster = Cluster(
        nodes=1,
        gpus_per_node=8,
        memory_bytes=96e9,
        peak_flops=989e12,
        efficiency=efficiency,
        intra_bw=450e9,
        inter_bw=50e9,
    )
    c = Candidate(1, 8, 1, 1, 3, "none", 2)
    time = step_time(
        c, validate(cfg, 8).family_model, cluster, global_batch=16, seq_len=8192, bytes_per_value=2
    )
    return {
        "memory_gib": mem.peak(2) / GIB,
        "memory_published_gib": 82.4,
        "tps_per_gpu": time.tokens_per_s / 8,
        "tps_published": 5762,
    }


def gpt3_175b(efficiency: float) -> dict[str, float]:
    cfg = Config()
    m = cfg.model
    m.vocab_size, m.dim, m.n_layers, m.n_heads = 51200, 12288, 96, 96
    m.ffn_dim, m.max_seq_len, m.pos_emb = 4 * 12288, 2048, "learned"
    model = validate(cfg, None).family_model
    cluster = Cluster(
        nodes=128,
        gpus_per_node=8,
        memory_bytes=80e9,
        peak_flops=312e12,
        efficiency=efficiency,
        intra_bw=300e9,
        inter_bw=25e9,
    )
    c = Candidate(8, 1, 8, 16, 1, "full", 1, "interleaved_1f1b")
    time = step_time(c, model, cluster, global_batch=1536, seq_len=2048, bytes_per_value=2)
    flops = model.flops_per_token(2048) * 1536 * 2048 * 4 / 3
    return {"tflops_per_gpu": flops / time.step_s / 1024 / 1e12, "tflops_published": 138}


SPEED_PRESETS = ("7b", "llama3-8b")
SPEED_ARGS = (
    "--nodes 8 --gpus-per-node 8 --gpu-memory 80GB --seq-len 4096 --global-batch 1024 --json"
)


PR_SET_CHILD_SUBREAPER = 36


def timed_run(command: list[str], env: dict[str, str]) -> tuple[str, float, float]:
    """(stdout, wall s, CPU s) of `command`. This process becomes a child subreaper (Linux
    prctl), so the processes the command leaves behind (the forkserver of its calibration
    workers, which their CPU time is charged to) are reparented here and waited for, and
    RUSAGE_CHILDREN counts all of them."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(command, check=True, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    with contextlib.suppress(ChildProcessError):
        while True:
            os.wait()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return done.stdout, wall, cpu


def plan_speed(out: str) -> None:
    """Time `distrain plan` for each of SPEED_PRESETS (one process each, as a user runs it),
    cold: its cache directory is a fresh one."""
    found = []
    for preset in SPEED_PRESETS:
        command = [sys.executable, "-m", "distrain", "plan", "--preset", preset]
        command += SPEED_ARGS.split()
        load_before = os.getloadavg()[0]
        with tempfile.TemporaryDirectory() as cache:
            stdout, wall, cpu = timed_run(command, {**os.environ, "XDG_CACHE_HOME": cache})
        rows = json.loads(stdout)
        found.append(
            {
                "preset": preset,
                "command": "distrain plan --preset " + preset + " " + SPEED_ARGS,
                "wall_s": wall,
                "cpu_s": cpu,
                "rows_shown": len(rows),
                "built_rows_shown": sum(r["memory_source"] == "fake build" for r in rows),
                "best": rows[0]["layout"] if rows else None,
                "load_before": load_before,
                "load_after": os.getloadavg()[0],
            }
        )
    header = f"{'preset':<12}{'wall s':>8}{'CPU s':>7}{'rows':>6}{'built':>7}"
    print(header + f"{'load before/after':>20}")
    for r in found:
        load = f"{r['load_before']:.1f} / {r['load_after']:.1f}"
        print(
            f"{r['preset']:<12}{r['wall_s']:>8.1f}{r['cpu_s']:>7.1f}{r['rows_shown']:>6}"
            f"{r['built_rows_shown']:>7}{load:>20}"
        )
    Path(out).write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "rows": found}, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--efficiency", type=float, default=0.45)
    parser.add_argument(
        "--measure",
        action="store_true",
        help="Predicted vs measured step time of small layouts on this machine (plan_steps.py).",
    )
    parser.add_argument(
        "--speed", action="store_true", help="Time `distrain plan` for 7B-class presets on 8x8."
    )
    parser.add_argument("--speed-out", default="plan_speed.json", help="JSON of --speed.")
    ns, rest = parser.parse_known_args()
    if ns.speed:
        plan_speed(ns.speed_out)
        return
    if ns.measure:
        from plan_steps import main as measure_main

        sys.exit(measure_main(rest))
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    llama = llama3_8b(ns.efficiency)
    gpt = gpt3_175b(ns.efficiency)
    print(f"efficiency {ns.efficiency} (fraction of peak the compute achieves)")
    print(f"{'run':<38}{'figure':<16}{'planned':>10}{'published':>11}{'ratio':>7}")
    for run, figure, planned, published in (
        ("Llama 3.1 8B, FSDP, 8 H100", "memory GiB/GPU", llama["memory_gib"], 82.4),
        ("Llama 3.1 8B, FSDP, 8 H100", "tokens/s/GPU", llama["tps_per_gpu"], 5762),
        ("GPT-3 175B, tp8 pp16 dp8, 1024 A100", "TFLOP/s/GPU", gpt["tflops_per_gpu"], 138),
    ):
        print(f"{run:<38}{figure:<16}{planned:>10.1f}{published:>11.1f}{planned / published:>7.2f}")


if __name__ == "__main__":
    main()
