"""Training throughput and model FLOPs utilization (MFU) of a preset in bf16, with and without
`training.compile`.

A real distrain `Trainer` (precision bf16, data parallel over --ranks ranks) runs --warmup untimed
steps, then --steps timed ones exactly as `Trainer.run` calls them (learning rate,
`loader.next_batch()`, `train_step`); on CUDA the device is synchronized before the clock starts
and stops, and the time is the slowest rank's. Then

    tokens/s = global batch x seq_len x steps / time
    achieved FLOP/s per device = tokens/s x flops_per_token(args, seq_len) / ranks
    MFU = achieved FLOP/s per device / peak FLOP/s per device

flops_per_token is PaLM's accounting (6 per matmul weight plus attention's 12 L T d; see
distrain.models.decoder.counts). Peak FLOP/s: --peak-tflops if given; on CUDA the dense bf16
peak of the GPU from a small table (H200 / H100 SXM 989, H100 PCIe 756, A100 312 TFLOP/s); on
CPU the achieved FLOP/s of a 2048^3 bf16 matmul measured here, so CPU "MFU" is relative to that,
not to a datasheet.

Variants: --variants (eager, compiled) x --activation-checkpointing (none, full, ...), in that
order, each a fresh `Trainer` in the same process. --micro-batch-size may list sizes, largest
first ("8,4,2"): the first variant tries them in order and keeps the first that does not run out
of memory; the others use it. A variant that fails (out of memory among others) is a row with its
error, and the run goes on. On CUDA each row also has `torch.cuda.max_memory_allocated` and
`max_memory_reserved` from the trainer's build to its last step. The JSON is rewritten after each
variant, so a run stopped midway leaves the rows it measured.

Defaults: on CUDA preset "1b", seq_len 2048, one rank per local GPU; on CPU preset "tiny",
seq_len 128, one process. Run from the repository root (the script launches its own ranks through
torchrun's API):

    python3 benchmarks/mfu.py                              # both variants, device defaults
    python3 benchmarks/mfu.py --no-compile-variant         # eager only (compile costs ~30 s on CPU)
    python3 benchmarks/mfu.py --micro-batch-size 8 --ranks 1 --peak-tflops 989
    python3 benchmarks/mfu.py --preset llama3-1b --micro-batch-size 8,4,2 --ranks 1 \
        --activation-checkpointing none,full

It prints a table and writes JSON to --out (default benchmarks/results/mfu.json).
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path
from typing import Any

import torch
from harness import (
    is_worker,
    launch_self,
    measure_steps,
    synchronize,
    trainer_for,
    worker_session,
    write_json,
)

from distrain.config.schema import Config
from distrain.models.decoder.counts import flops_per_token, num_params
from distrain.models.registry import family_of_preset
from distrain.parallel.device import DistContext

# Dense bf16 peak FLOP/s per GPU, matched in order against torch.cuda.get_device_name().
GPU_PEAK_FLOPS = (
    ("H100 PCIe", 756e12),
    ("H200", 989e12),
    ("H100", 989e12),
    ("A100", 312e12),
)
# The corpus only supplies token windows; this prefix of the default one holds enough of them
# (the loader wraps around epochs if a run reads more).
CORPUS_BYTES = 8_000_000
MATMUL_SIZE = 2048


def parse_args(argv: list[str]) -> argparse.Namespace:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="1b" if cuda else "tiny")
    parser.add_argument("--seq-len", type=int, default=2048 if cuda else 128)
    parser.add_argument(
        "--micro-batch-size",
        type=_sizes,
        default=[4],
        help="sequences per rank; a list (8,4,2) takes the first that fits the first variant",
    )
    parser.add_argument(
        # Not --nproc: torchrun's parser would take that for its --nproc-per-node.
        "--ranks",
        type=int,
        default=torch.cuda.device_count() if cuda else 1,
        help="ranks (data parallel); default: every local GPU, or 1 on CPU",
    )
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps (include compiling)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps")
    parser.add_argument(
        "--peak-tflops", type=float, help="peak bf16 TFLOP/s per device (overrides the default)"
    )
    parser.add_argument(
        "--no-compile-variant",
        action="store_true",
        help="measure only the eager model (skip training.compile); same as --variants eager",
    )
    parser.add_argument(
        "--variants",
        default="eager,compiled",
        help="comma-separated: eager (training.compile off), compiled (on)",
    )
    parser.add_argument(
        "--activation-checkpointing",
        default="none",
        help="comma-separated training.activation_checkpointing values, each a variant",
    )
    parser.add_argument("--out", default="benchmarks/results/mfu.json", help="JSON output")
    # Set by the launcher for its workers: a run directory every rank shares.
    parser.add_argument("--run-dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    kinds = args.variants.split(",")
    if not set(kinds) <= {"eager", "compiled"}:
        parser.error(f"--variants {args.variants}: expected eager and/or compiled")
    if args.no_compile_variant:
        kinds = ["eager"]
    args.variant_list = [
        (kind == "compiled", ac)
        for kind in kinds
        for ac in args.activation_checkpointing.split(",")
    ]
    return args


def _sizes(text: str) -> list[int]:
    return [int(part) for part in text.split(",")]


def make_config(
    args: argparse.Namespace,
    compile_: bool,
    world_size: int,
    run_dir: Path,
    *,
    micro_batch_size: int,
    checkpointing: str = "none",
) -> Config:
    cfg = Config()
    cfg.run.dir = str(run_dir)
    cfg.model.preset = args.preset
    cfg.model.family = family_of_preset(args.preset) or cfg.model.family
    cfg.data.max_bytes = CORPUS_BYTES
    t = cfg.training
    t.precision = "bf16"
    t.compile = compile_
    t.activation_checkpointing = checkpointing
    t.micro_batch_size = micro_batch_size
    t.seq_len = args.seq_len
    t.global_batch_size = micro_batch_size * world_size
    t.steps = args.warmup + args.steps
    cfg.metrics.progress_bar = False
    cfg.metrics.tensorboard = False
    cfg.checkpoint.at_end = False
    cfg.checkpoint.interval_steps = 0
    cfg.validate()
    return cfg


def matmul_flops(device: torch.device, reps: int = 10) -> float:
    """Achieved FLOP/s of a MATMUL_SIZE^3 bf16 matmul on this device."""
    a = torch.randn(MATMUL_SIZE, MATMUL_SIZE, device=device, dtype=torch.bfloat16)
    b = torch.randn(MATMUL_SIZE, MATMUL_SIZE, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    synchronize(device)
    start = time.perf_counter()
    for _ in range(reps):
        a @ b
    synchronize(device)
    return 2 * MATMUL_SIZE**3 * reps / (time.perf_counter() - start)


def peak_flops(args: argparse.Namespace, device: torch.device) -> tuple[float, str]:
    """Peak bf16 FLOP/s per device and where the figure comes from."""
    if args.peak_tflops is not None:
        return args.peak_tflops * 1e12, "--peak-tflops"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, flops in GPU_PEAK_FLOPS:
            if key in name:
                return flops, f"datasheet dense bf16 ({name})"
        raise SystemExit(f"no peak FLOP/s known for GPU {name!r}; pass --peak-tflops")
    return matmul_flops(device), f"measured {MATMUL_SIZE}^3 bf16 matmul on this CPU"


def run_variant(
    args: argparse.Namespace,
    compile_: bool,
    ctx: DistContext,
    logger: Any,
    run_dir: Path,
    *,
    micro_batch_size: int,
    checkpointing: str = "none",
) -> dict[str, Any]:
    name = f"compile{int(compile_)}-ac-{checkpointing}-mb{micro_batch_size}"
    cfg = make_config(
        args,
        compile_,
        ctx.world_size,
        run_dir / name,
        micro_batch_size=micro_batch_size,
        checkpointing=checkpointing,
    )
    Path(cfg.run.dir).mkdir(parents=True, exist_ok=True)
    cuda = ctx.device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(ctx.device)
    trainer = trainer_for(cfg, ctx, logger)
    try:
        seconds = measure_steps(trainer, warmup=args.warmup, steps=args.steps, device=ctx.device)
        model_args = trainer.plan.model
        memory = (
            {
                "allocated_peak": torch.cuda.max_memory_allocated(ctx.device),
                "reserved_peak": torch.cuda.max_memory_reserved(ctx.device),
            }
            if cuda
            else {}
        )
    finally:
        trainer.close()
    del trainer
    gc.collect()
    if ctx.device.type == "cuda":
        torch.cuda.empty_cache()
    tokens_per_s = cfg.training.global_batch_size * cfg.training.seq_len * args.steps / seconds
    return {
        "compile": compile_,
        "activation_checkpointing": checkpointing,
        "micro_batch_size": micro_batch_size,
        **memory,
        "params": num_params(model_args),
        "flops_per_token": flops_per_token(model_args, cfg.training.seq_len),
        "step_s": seconds / args.steps,
        "tokens_per_s": tokens_per_s,
    }


def report(
    args: argparse.Namespace,
    rows: list[dict[str, Any]],
    ctx: DistContext,
    peak: float,
    source: str,
    *,
    table: bool = True,
) -> None:
    """Add achieved FLOP/s and MFU to each measured row, print the table (`table`) and write the
    JSON."""
    for r in rows:
        if "tokens_per_s" in r:
            r["achieved_flops_per_device"] = (
                r["tokens_per_s"] * r["flops_per_token"] / ctx.world_size
            )
            r["mfu"] = r["achieved_flops_per_device"] / peak
    device = torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else "CPU"
    sizes = sorted({r["micro_batch_size"] for r in rows if "tokens_per_s" in r}, reverse=True)
    if table:
        print(
            f"\nbf16 training throughput on {ctx.world_size} x {device}: seq_len {args.seq_len}, "
            f"micro-batch {','.join(map(str, sizes)) or '-'} per rank, {args.warmup} warmup + "
            f"{args.steps} timed steps; peak {peak / 1e12:.1f} TFLOP/s per device ({source})"
        )
        header = (
            f"{'preset':>10}  {'params':>8}  {'compile':>7}  {'AC':>9}  {'mb':>3}  "
            f"{'tokens/s':>10}  {'TFLOP/s/dev':>11}  {'MFU':>6}  {'peak GiB':>8}"
        )
        print(header)
        print("-" * len(header))
        for r in rows:
            lead = (
                f"{args.preset:>10}  {r.get('params', 0) / 1e6:>7.1f}M  {str(r['compile']):>7}  "
                f"{r['activation_checkpointing']:>9}  {r['micro_batch_size']:>3}  "
            )
            if "tokens_per_s" not in r:
                print(lead + f"failed: {r['error'][:80]}")
                continue
            gib = r["allocated_peak"] / 2**30 if "allocated_peak" in r else float("nan")
            print(
                lead + f"{r['tokens_per_s']:>10,.0f}  "
                f"{r['achieved_flops_per_device'] / 1e12:>11.3f}  {r['mfu']:>6.1%}  {gib:>8.2f}"
            )
    result = {
        "config": {
            "preset": args.preset,
            "seq_len": args.seq_len,
            # The size the variants ran with (the first that fitted), or the list when none did.
            "micro_batch_size": sizes[0] if len(sizes) == 1 else sizes or args.micro_batch_size,
            "ranks": ctx.world_size,
            "device": device,
            "precision": "bf16",
            "warmup": args.warmup,
            "steps": args.steps,
            "peak_flops_per_device": peak,
            "peak_source": source,
            "torch": torch.__version__,
        },
        "rows": rows,
    }
    write_json(args.out, result)


def worker(args: argparse.Namespace) -> None:
    run_dir = Path(args.run_dir)
    with worker_session(run_dir, "auto") as (ctx, logger):
        peak, source = peak_flops(args, ctx.device)
        sizes = list(args.micro_batch_size)
        rows: list[dict[str, Any]] = []
        for compile_, ac in args.variant_list:
            # The first variant walks the sizes down until one fits; the rest keep that one.
            while True:
                mb = sizes[0]
                try:
                    row = run_variant(
                        args, compile_, ctx, logger, run_dir, micro_batch_size=mb, checkpointing=ac
                    )
                except Exception as e:  # noqa: BLE001 - recorded in the row; the run goes on
                    if ctx.world_size > 1:
                        raise  # the other ranks would wait for this one in a collective
                    row = {
                        "compile": compile_,
                        "activation_checkpointing": ac,
                        "micro_batch_size": mb,
                        "error": f"{type(e).__name__}: {e}"[:2000],
                        "out_of_memory": isinstance(e, torch.OutOfMemoryError),
                    }
                gc.collect()
                if ctx.device.type == "cuda":
                    torch.cuda.empty_cache()
                if row.get("out_of_memory") and not rows and len(sizes) > 1:
                    print(f"micro-batch {mb} ran out of memory; trying {sizes[1]}", flush=True)
                    sizes.pop(0)
                    continue
                break
            rows.append(row)
            if ctx.rank == 0:
                report(args, rows, ctx, peak, source, table=False)
        if ctx.rank == 0:
            report(args, rows, ctx, peak, source)
        if any("error" in r for r in rows):
            sys.exit(f"{sum('error' in r for r in rows)} of {len(rows)} variants failed")


def main() -> None:
    argv = sys.argv[1:]
    args = parse_args(argv)
    if is_worker():
        worker(args)
    else:
        launch_self(__file__, args.ranks, argv, name="mfu")


if __name__ == "__main__":
    main()
