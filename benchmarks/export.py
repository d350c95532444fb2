"""Time and peak memory of `distrain export --format hf` from a checkpoint of a Hugging Face-shaped
family's preset (default: the gpt2 family's `gpt2`, 124M parameters), in fp32 and bf16.

A 1-step run of the preset (1 sequence of 32 tokens, 200 KB of the default corpus) writes the
checkpoint; each export then runs in a fresh Python process, so its peak resident memory (the
kernel's VmHWM, which starts afresh at exec, unlike `ru_maxrss`) is its own, and is reported next
to the memory the process held after its imports and to the size of the fp32 weights: the
export streams tensors from the DCP checkpoint, so its peak stays well under one copy of the
model.

    python3 benchmarks/export.py                       # gpt2, fp32 and bf16
    python3 benchmarks/export.py --family llama --preset llama-tiny

Prints a table and writes JSON to --out (default benchmarks/results/export.json).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import write_json

from distrain.config.io import load_config
from distrain.models.registry import model_family


def train_one_step(run_dir: Path, family: str, preset: str) -> None:
    from distrain.train.worker import run_training

    fields = {
        "run.dir": str(run_dir),
        "model.family": family,
        "model.preset": preset,
        "training.steps": "1",
        "training.global_batch_size": "1",
        "training.micro_batch_size": "1",
        "training.seq_len": "32",
        "training.eval_interval_steps": "0",
        "checkpoint.interval_steps": "0",
        "checkpoint.at_end": "true",
        "data.max_bytes": "200000",
        "metrics.progress_bar": "false",
        "metrics.tensorboard": "false",
    }
    run_training(load_config(None, list(fields.items())))


def peak_rss_mb() -> float:
    """This process's peak resident memory so far (VmHWM of /proc/self/status), in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status (Linux only)")


def export_once(run_dir: Path, out: Path, dtype: str) -> dict:
    """In this (fresh) process: export and measure."""
    from distrain.interop.export import export_hf

    after_imports_mb = peak_rss_mb()
    start = time.perf_counter()
    export_hf(run_dir, out, dtype=dtype)
    return {
        "dtype": dtype,
        "seconds": time.perf_counter() - start,
        "peak_rss_mb": peak_rss_mb(),
        "after_imports_mb": after_imports_mb,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--family", default="gpt2")
    parser.add_argument("--preset", default="gpt2")
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"])
    parser.add_argument("--out", default="benchmarks/results/export.json")
    parser.add_argument("--export-only", nargs=3, metavar=("RUN_DIR", "OUT", "DTYPE"))
    ns = parser.parse_args()
    if ns.export_only:
        run_dir, out, dtype = ns.export_only
        print(json.dumps(export_once(Path(run_dir), Path(out), dtype)))
        return
    spec = model_family(ns.family)
    weights_mb = spec.num_params(spec.presets[ns.preset]) * 4 / 2**20
    rows = []
    with tempfile.TemporaryDirectory(prefix="distrain-export-") as tmp:
        run_dir = Path(tmp) / "run"
        train_one_step(run_dir, ns.family, ns.preset)
        for dtype in ns.dtypes:
            out = f"{tmp}/{dtype}"
            argv = [sys.executable, __file__, "--export-only", str(run_dir), out, dtype]
            done = subprocess.run(argv, capture_output=True, text=True, check=True)
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(f"{ns.preset}: {weights_mb:.0f} MB of fp32 weights")
    print(f"{'dtype':>6} {'seconds':>8} {'peak RSS MB':>12} {'after imports MB':>17}")
    for r in rows:
        print(
            f"{r['dtype']:>6} {r['seconds']:>8.1f} {r['peak_rss_mb']:>12.0f} "
            f"{r['after_imports_mb']:>17.0f}"
        )
    write_json(ns.out, {"preset": ns.preset, "weights_fp32_mb": weights_mb, "rows": rows})


if __name__ == "__main__":
    main()
