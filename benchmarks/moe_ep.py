"""Expert parallelism on 2 ranks: tokens/s of an MoE preset at ep1 (plain data parallel, every
rank holds every expert) and ep2 (experts split, tokens exchanged with all-to-all), and the
all-to-all bytes per step measured against the theory.

Each configuration is one `distrain train --nproc 2` run (fp32, CPU/gloo here) of STEPS steps;
tokens/s is the median over the logged steps after the first two. At ep2 `comm_bytes` less
`comm_layout_bytes` (FSDP2's own collectives, recorded apart) is the all-to-all bytes rank 0
sends per step, dispatch and combine of every MoE layer. Theory for one exchange of one layer
under balanced routing: top_k x tokens x dim x 4 bytes x (ep - 1) / ep (the share of routed
copies whose expert lives on another rank); measured / theory near 1 means the router spreads
tokens evenly, and the dispatch sends nothing but the rows.

    python3 benchmarks/moe_ep.py                       # moe-tiny, 12 steps
    python3 benchmarks/moe_ep.py --preset switch-tiny --steps 20

Writes JSON to --out (default benchmarks/results/moe_ep.json).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from harness import write_json

from distrain.config.io import load_config
from distrain.models.registry import model_args

EP = 2
BATCH, MICRO, SEQ = 16, 4, 128


def train(preset: str, steps: int, ep: int, run_dir: Path) -> list[dict]:
    fields = {
        "model.preset": preset,
        "parallel.ep": ep,
        "training.steps": steps,
        "training.global_batch_size": BATCH,
        "training.micro_batch_size": MICRO,
        "training.seq_len": SEQ,
        "training.log_interval_steps": 1,
        "training.eval_interval_steps": 0,
        "checkpoint.interval_steps": 0,
        "checkpoint.at_end": "false",
        "metrics.progress_bar": "false",
        "metrics.tensorboard": "false",
        "data.max_bytes": 4_000_000,
    }
    args = [f"--{k}={v}" for k, v in fields.items()]
    cmd = [sys.executable, "-m", "distrain", "train", "--nproc", "2", "--run-dir", str(run_dir)]
    subprocess.run([*cmd, *args], check=True, capture_output=True, text=True)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [row for row in map(json.loads, lines) if "loss" in row]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="moe-tiny")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--out", default="benchmarks/results/moe_ep.json")
    opts = parser.parse_args()
    model = model_args(load_config(None, [("model.preset", opts.preset)]).model)
    moe = model.moe
    layers = sum(moe.is_moe_layer(i) for i in range(model.n_layers))
    result: dict = {"preset": opts.preset, "ranks": 2, "global_batch": BATCH, "seq_len": SEQ}
    with tempfile.TemporaryDirectory() as tmp:
        for ep in (1, EP):
            rows = train(opts.preset, opts.steps, ep, Path(tmp) / f"ep{ep}")
            result[f"ep{ep}_tokens_per_s"] = statistics.median(r["tokens_per_s"] for r in rows[2:])
            if ep > 1:
                measured = statistics.median(
                    r["comm_bytes"] - r.get("comm_layout_bytes", 0) for r in rows
                )
    tokens = BATCH * SEQ // 2
    theory = moe.top_k * tokens * model.dim * 4 * (EP - 1) / EP
    result["all_to_all_bytes_per_step"] = measured
    result["theory_bytes_per_exchange"] = theory
    result["measured_over_theory"] = measured / (2 * layers) / theory
    print(f"{'figure':<28}{'value':>16}")
    for key, value in result.items():
        print(f"{key:<28}{value:>16,.3f}" if isinstance(value, float) else f"{key:<28}{value:>16}")
    write_json(opts.out, result)


if __name__ == "__main__":
    main()
