"""Training throughput of mixture-of-experts presets against the dense model with the same active
parameters per token (1 rank; data parallel over --nproc ranks if asked).

`moe-tiny` (8 experts of width 256, top-2) and `switch-tiny` (8 experts of width 512, top-1,
capacity 1.25) each use per token exactly `tiny`'s parameters plus a router (see
distrain.models.decoder.counts.active_params), so the tokens/s gap is the cost of routing,
sorting and running the experts as separate matmuls (a loop on CPU, torch._grouped_mm on CUDA
in bf16).

A real distrain `Trainer` runs --warmup untimed steps, then --steps timed ones as `Trainer.run`
calls them; on CUDA the device is synchronized before the clock starts and stops, and the time
is the slowest rank's. Run from the repository root:

    python3 benchmarks/moe.py                         # fp32 on CPU, bf16 on CUDA
    python3 benchmarks/moe.py --presets tiny moe-tiny --steps 20

It prints a table and writes JSON to --out (default benchmarks/results/moe.json).
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path
from typing import Any

import torch
from harness import (
    bench_config,
    is_worker,
    launch_self,
    measure_steps,
    trainer_for,
    worker_session,
    write_json,
)

from distrain.config.schema import Config
from distrain.models.decoder.counts import active_params, flops_per_token, num_params
from distrain.parallel.device import DistContext

CORPUS_BYTES = 8_000_000


def parse_args(argv: list[str]) -> argparse.Namespace:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", nargs="+", default=["tiny", "moe-tiny", "switch-tiny"])
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro-batch-size", type=int, default=8, help="sequences per rank")
    parser.add_argument("--precision", default="bf16" if cuda else "fp32")
    parser.add_argument("--nproc", type=int, default=1, help="ranks (data parallel)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps")
    parser.add_argument("--steps", type=int, default=10, help="timed steps")
    parser.add_argument("--out", default="benchmarks/results/moe.json", help="JSON output")
    # Set by the launcher for its workers: a run directory every rank shares.
    parser.add_argument("--run-dir", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def make_config(args: argparse.Namespace, preset: str, world_size: int, run_dir: Path) -> Config:
    steps = args.warmup + args.steps
    return bench_config(
        run_dir,
        preset=preset,
        micro_batch_size=args.micro_batch_size,
        seq_len=args.seq_len,
        global_batch_size=args.micro_batch_size * world_size,
        steps=steps,
        max_bytes=CORPUS_BYTES,
        training__precision=args.precision,
        # No metric rows (and no host reads) in the timed steps.
        training__log_interval_steps=steps + 1,
    )


def run_preset(
    args: argparse.Namespace, preset: str, ctx: DistContext, logger: Any, run_dir: Path
) -> dict[str, Any]:
    cfg = make_config(args, preset, ctx.world_size, run_dir / preset)
    Path(cfg.run.dir).mkdir(parents=True, exist_ok=True)
    trainer = trainer_for(cfg, ctx, logger)
    try:
        seconds = measure_steps(
            trainer, warmup=args.warmup, steps=args.steps, device=ctx.device, report_loss=False
        )
        model_args = trainer.plan.model
    finally:
        trainer.close()
    del trainer
    gc.collect()
    t = cfg.training
    return {
        "preset": preset,
        "experts": model_args.moe.num_experts,
        "top_k": model_args.moe.top_k if model_args.moe.enabled else 0,
        "params": num_params(model_args),
        "active_params": active_params(model_args),
        "flops_per_token": flops_per_token(model_args, t.seq_len),
        "step_s": seconds / args.steps,
        "tokens_per_s": t.global_batch_size * t.seq_len * args.steps / seconds,
    }


def report(args: argparse.Namespace, rows: list[dict[str, Any]], ctx: DistContext) -> None:
    device = torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else "CPU"
    dense = next((r for r in rows if r["experts"] == 0), None)
    print(
        f"\n{args.precision} training throughput on {ctx.world_size} x {device}: seq_len "
        f"{args.seq_len}, micro-batch {args.micro_batch_size} per rank, {args.warmup} warmup + "
        f"{args.steps} timed steps"
    )
    header = (
        f"{'preset':>12}  {'experts':>7}  {'top_k':>5}  {'params':>8}  {'active':>8}  "
        f"{'tokens/s':>10}  {'vs dense':>8}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        ratio = f"{r['tokens_per_s'] / dense['tokens_per_s']:.2f}x" if dense else "-"
        print(
            f"{r['preset']:>12}  {r['experts']:>7}  {r['top_k']:>5}  {r['params'] / 1e6:>7.2f}M  "
            f"{r['active_params'] / 1e6:>7.2f}M  {r['tokens_per_s']:>10,.0f}  {ratio:>8}"
        )
    config = {
        "seq_len": args.seq_len,
        "micro_batch_size": args.micro_batch_size,
        "ranks": ctx.world_size,
        "device": device,
        "precision": args.precision,
        "warmup": args.warmup,
        "steps": args.steps,
        "torch": torch.__version__,
    }
    write_json(args.out, {"config": config, "rows": rows})


def worker(args: argparse.Namespace) -> None:
    run_dir = Path(args.run_dir)
    with worker_session(run_dir, "auto") as (ctx, logger):
        rows = [run_preset(args, p, ctx, logger, run_dir) for p in args.presets]
        if ctx.rank == 0:
            report(args, rows, ctx)


def main() -> None:
    argv = sys.argv[1:]
    args = parse_args(argv)
    if is_worker():
        worker(args)
    else:
        launch_self(__file__, args.nproc, argv, name="moe")


if __name__ == "__main__":
    main()
