"""The longest sequence one rank fits, without and with context parallelism, measured.

For each context-parallel degree (default 1 and 2; one torchrun launch each, CPU/gloo, cp = the
world size), each `parallel.cp_method` above cp 1 (default allgather and ring: a launch each) and
each sequence length (doubling), a real distrain `Trainer` (preset tiny,
micro-batch 1, `model.max_seq_len` = the sequence length) takes one training step to settle its
buffers, then one more forward and backward is measured on every rank:

- activations: bytes of the tensors autograd saves for backward (parameters excluded), counted
  exactly by a saved-tensors hook (each storage once): the memory that grows with the sequence;
- peak RSS: the process's resident-set high-water mark during that forward and backward
  (`VmHWM`, reset through /proc/self/clear_refs before it; there are no CPU allocator stats).
  It includes parameters, gradients, optimizer state and whatever glibc keeps, so it is an upper
  bound on what the step needs.

The table shows the largest value over ranks, and "fits" names the longest measured sequence
whose peak RSS stays within --budget-mib per rank.

    python3 benchmarks/context.py                       # cp 1 and 2, 2k..16k tokens
    python3 benchmarks/context.py --cp 2 --methods ring --seq-lens 2048,4096
    python3 benchmarks/context.py --seq-lens 1024,2048 --budget-mib 512

It prints a table and writes JSON to --out (default benchmarks/results/context.json).
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from harness import bench_config, is_worker, launch_ranks, trainer_for, worker_session, write_json

from distrain.config.schema import Config
from distrain.train.loop import Trainer

CORPUS_BYTES = 2_000_000
MIB = 2**20


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ints = lambda s: [int(n) for n in s.split(",")]  # noqa: E731
    parser.add_argument("--cp", type=ints, default=[1, 2], help="context-parallel degrees")
    parser.add_argument("--seq-lens", type=ints, default=[2048, 4096, 8192, 16384])
    parser.add_argument(
        "--methods", default="allgather,ring", help="parallel.cp_method values (cp > 1)"
    )
    parser.add_argument("--method", default="allgather", help=argparse.SUPPRESS)  # a launch's
    parser.add_argument("--budget-mib", type=float, default=1024, help="memory per rank")
    parser.add_argument("--out", default="benchmarks/results/context.json", help="JSON output")
    parser.add_argument("--run-dir", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def make_config(seq_len: int, cp: int, method: str, run_dir: Path) -> Config:
    return bench_config(
        run_dir,
        device="cpu",
        preset="tiny",
        micro_batch_size=1,
        seq_len=seq_len,
        global_batch_size=1,
        steps=2,
        max_bytes=CORPUS_BYTES,
        model__max_seq_len=seq_len,
        parallel__cp=cp,
        parallel__cp_method=method,
        training__eval_batches=1,
    )


def high_water_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def measure(trainer: Trainer) -> dict[str, float]:
    """Peak RSS and saved-activation bytes of one forward and backward, after a settling step."""
    trainer.train_step(trainer.loader.next_batch())
    params = {p.untyped_storage().data_ptr() for p in trainer.model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    batch = trainer.loader.next_batch()
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        trainer.model.forward_backward(batch, trainer.optimizers.scale)
    peak = high_water_mib()
    trainer.optimizers.zero_grad()
    return {"peak_rss_mib": peak, "activations_mib": sum(saved.values()) / MIB}


def worker(args: argparse.Namespace) -> None:
    run_dir = Path(args.run_dir)
    rows = []
    with worker_session(run_dir) as (ctx, logger):
        for seq_len in args.seq_lens:
            cfg = make_config(seq_len, ctx.world_size, args.method, run_dir / f"seq{seq_len}")
            Path(cfg.run.dir).mkdir(parents=True, exist_ok=True)
            trainer = trainer_for(cfg, ctx, logger)
            try:
                mine = measure(trainer)
            finally:
                trainer.close()
            del trainer
            gc.collect()
            per_rank: list[dict[str, float]] = [{} for _ in range(ctx.world_size)]
            dist.all_gather_object(per_rank, mine)
            row = {
                "cp": ctx.world_size,
                "method": args.method,
                "seq_len": seq_len,
                "per_rank": per_rank,
            }
            for key in ("peak_rss_mib", "activations_mib"):
                row[key] = max(r[key] for r in per_rank)
            rows.append(row)
            if ctx.rank == 0:
                print(json.dumps({k: v for k, v in row.items() if k != "per_rank"}), flush=True)
        if ctx.rank == 0:
            (run_dir / f"cp{ctx.world_size}-{args.method}.json").write_text(json.dumps(rows))


def report(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    print("\ntiny preset, micro-batch 1, CPU/gloo; per rank, largest over ranks")
    print("| cp | method | seq_len | tokens per rank | activations MiB | peak RSS MiB |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['cp']} | {r['method'] if r['cp'] > 1 else '-'} | {r['seq_len']} "
            f"| {r['seq_len'] // r['cp']} | {r['activations_mib']:.1f} | {r['peak_rss_mib']:.0f} |"
        )
    fits = {}
    for cp, method in launches(args):
        name = f"cp{cp}" + (f" {method}" if cp > 1 else "")
        ok = [
            r["seq_len"]
            for r in rows
            if (r["cp"], r["method"]) == (cp, method) and r["peak_rss_mib"] <= args.budget_mib
        ]
        fits[name] = max(ok) if ok else None
        print(f"{name}: longest measured sequence within {args.budget_mib:.0f} MiB: {fits[name]}")
    write_json(args.out, {"budget_mib": args.budget_mib, "fits": fits, "rows": rows})


def launches(args: argparse.Namespace) -> list[tuple[int, str]]:
    """(cp, method) of each launch: one for cp 1, one per method above it."""
    methods = args.methods.split(",")
    return [(cp, method) for cp in args.cp for method in (["allgather"] if cp == 1 else methods)]


def main() -> None:
    args = parse_args(sys.argv[1:])
    if is_worker():
        worker(args)
        return
    run_dir = tempfile.mkdtemp(prefix="distrain-context-")
    try:
        rows = []
        for cp, method in launches(args):
            launch_ranks(__file__, cp, [*sys.argv[1:], "--method", method], run_dir=run_dir)
            rows += json.loads((Path(run_dir) / f"cp{cp}-{method}.json").read_text())
        report(args, rows)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
