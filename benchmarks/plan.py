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

With --speed, how long `distrain plan` takes for every preset of every registered model family
on the question a user asks first, 8 nodes x 8 GPUs of 80 GB at the default batch (`--nodes 8
--gpus-per-node 8 --gpu-memory 80GB`), and for the 7B-class presets (5 to 10 billion parameters)
also the long question (SPEED_ARGS: seq 4096, global batch 1024): cold (a fresh cache directory:
every fake build made) then warm (the same cache, a second process: every build read back). For
each: wall seconds, CPU seconds (user + system of the command and every process it starts, its
build workers included), rows shown and rows built on fake tensors, the files the cold plan kept
in its build store (fake builds and parameter tables), whether the warm answer is the cold one,
and the load average before and after each run (the machine's other work slows it), as a table
and JSON (written after every preset, so a run cut short keeps what it measured). `--presets
a,b` times only those.

    python3 benchmarks/plan.py [--efficiency 0.45]
    python3 benchmarks/plan.py --measure [--rounds 5 --steps 3]   # this machine, see plan_steps.py
    python3 benchmarks/plan.py --speed [--presets all|a,b] [--speed-out PATH]
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
from typing import Any

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


DEFAULT_QUESTION = "--nodes 8 --gpus-per-node 8 --gpu-memory 80GB --json"
LONG_CLASS = (5e9, 10e9)  # parameters of the presets asked the long question (SPEED_ARGS) too


def speed_presets(names: str) -> list[tuple[str, str, int]]:
    """(preset, family, parameters) of every registered family's presets ("all") or of the named
    ones, smallest first."""
    from distrain.models.registry import families

    known = {
        name: (spec.name, spec.num_params(args))
        for spec in families().values()
        for name, args in spec.presets.items()
    }
    chosen = list(known) if names == "all" else names.split(",")
    unknown = [n for n in chosen if n not in known]
    if unknown:
        raise SystemExit(f"unknown presets: {', '.join(unknown)}; choose from {', '.join(known)}")
    return sorted(((n, *known[n]) for n in chosen), key=lambda p: (p[2], p[0]))


def plan_once(command: list[str], env: dict[str, str]) -> tuple[str, dict[str, Any]]:
    """One `distrain plan` process: its stdout and what it cost."""
    load_before = os.getloadavg()[0]
    stdout, wall, cpu = timed_run(command, env)
    rows = json.loads(stdout)
    return stdout, {
        "wall_s": round(wall, 2),
        "cpu_s": round(cpu, 2),
        "rows_shown": len(rows),
        "built_rows_shown": sum(r["memory_source"] == "fake build" for r in rows),
        "best": rows[0]["layout"] if rows else None,
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
    }


def plan_speed(out: str, names: str) -> None:
    """Time `distrain plan` (one process each, as a user runs it) for each preset and question,
    cold (a fresh cache directory) then warm (the same directory, a second process)."""
    from harness import write_json

    found: list[dict[str, Any]] = []
    print(
        f"{'preset':<14}{'question':<10}{'cold s':>8}{'CPU s':>7}{'warm s':>8}{'CPU s':>7}"
        f"{'stored':>8}{'same':>6}{'load before/after':>20}",
        flush=True,
    )
    for preset, family, params in speed_presets(names):
        questions = [("default", DEFAULT_QUESTION)]
        if LONG_CLASS[0] <= params < LONG_CLASS[1]:
            questions.append(("1024x4096", SPEED_ARGS))
        for question, args in questions:
            command = [sys.executable, "-m", "distrain", "plan", "--preset", preset, *args.split()]
            row: dict[str, Any] = {
                "preset": preset,
                "family": family,
                "params": params,
                "question": question,
                "command": f"distrain plan --preset {preset} {args}",
            }
            with tempfile.TemporaryDirectory() as cache:
                env = {**os.environ, "XDG_CACHE_HOME": cache}
                try:
                    cold_out, row["cold"] = plan_once(command, env)
                    row["stored_builds"] = sum(
                        1 for p in Path(cache).rglob("*") if p.is_file() and "builds" in p.parts
                    )
                    warm_out, row["warm"] = plan_once(command, env)
                    del row["warm"]["best"]  # the same_answer check compares whole answers
                    row["same_answer"] = cold_out == warm_out
                except subprocess.CalledProcessError as e:
                    row["error"] = (e.stderr or "").strip().splitlines()[-1:] or [str(e)]
            found.append(row)
            if "error" in row:
                print(f"{preset:<14}{question:<10} failed: {row['error'][0]}", flush=True)
            else:
                c, w = row["cold"], row["warm"]
                load = f"{c['load_before']:.1f} / {w['load_after']:.1f}"
                print(
                    f"{preset:<14}{question:<10}{c['wall_s']:>8.1f}{c['cpu_s']:>7.1f}"
                    f"{w['wall_s']:>8.1f}{w['cpu_s']:>7.1f}{row['stored_builds']:>8}"
                    f"{'yes' if row['same_answer'] else 'no':>6}{load:>20}",
                    flush=True,
                )
            write_json(out, {"date": time.strftime("%Y-%m-%d"), "rows": found})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--efficiency", type=float, default=0.45)
    parser.add_argument(
        "--measure",
        action="store_true",
        help="Predicted vs measured step time of small layouts on this machine (plan_steps.py).",
    )
    parser.add_argument(
        "--speed", action="store_true", help="Time `distrain plan` cold and warm per preset."
    )
    parser.add_argument("--presets", default="all", help="--speed: all, or a,b (preset names).")
    parser.add_argument(
        "--speed-out", default="benchmarks/results/plan_speed_presets.json", help="JSON of --speed."
    )
    ns, rest = parser.parse_known_args()
    if ns.speed:
        plan_speed(ns.speed_out, ns.presets)
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
