"""Per-rank memory of parameters, gradients and optimizer state under ZeRO stages 0-3, measured.

For each world size (default 1, 2, 4; one torchrun launch each, CPU/gloo) and each
`parallel.zero_stage` (0 DDP, 1 ZeroRedundancyOptimizer, 2 and 3 FSDP2), a real distrain `Trainer`
takes one training step, then every rank counts the bytes it holds (there are no CPU allocator
stats, so the bytes of each tensor's local part are summed; a DTensor counts its `.to_local()`):

- params: every parameter of `trainer.model.parts`, at rest after the step;
- grads: `p.grad` of those parameters between backward and the optimizer step, from one more
  `forward_backward` run by this script (train_step frees the gradients at its end), then freed;
- optimizer: `exp_avg` and `exp_avg_sq` of every AdamW state. For ZeRO-1 that is the wrapped
  `optimizer.optim.state` (this rank's partition); ZeroRedundancyOptimizer's own `.state` is empty
  between steps. AdamW's per-parameter `step` scalars are counted apart (column "step B") and left
  out of the comparison.

Next to each value stands the ZeRO paper's accounting for fp32 Adam (Rajbhandari et al. 2019), with
Psi = parameter count and N = data-parallel size: params 4 Psi (stage 3: 4 Psi / N), grads 4 Psi
(stage >= 2: 4 Psi / N), optimizer 8 Psi (stage >= 1: 8 Psi / N), and the ratio measured / theory.
The table shows the largest value over ranks (what each rank must fit).

Run from the repository root (the script launches its own ranks through torchrun's API):

    python3 benchmarks/memory.py                          # preset small, world sizes 1,2,4
    python3 benchmarks/memory.py --world-sizes 2 --preset tiny

It prints a table and writes JSON to --out (default benchmarks/results/memory.json).
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
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor

from distrain.config.schema import Config
from distrain.models.decoder.counts import num_params
from distrain.train.loop import Trainer

STAGES = (0, 1, 2, 3)
# The corpus only supplies token windows; a 2 MB prefix of the default one is plenty.
CORPUS_BYTES = 2_000_000
MOMENTS = ("exp_avg", "exp_avg_sq")
FOOTER = """\
params: at rest after a step. Stage 2 (FSDP2, reshard_after_forward=False) keeps parameters
  gathered only from forward to the end of backward and reshards them after backward, so at rest
  they are 4 Psi / N like stage 3; the paper's 4 Psi for stage 2 is its footprint during a step.
grads: p.grad between backward and optimizer step. Stages 0/1 (DDP) hold full gradients; DDP's
  communication buckets are not counted. Stages 2/3 hold reduce-scattered shards.
optimizer: exp_avg + exp_avg_sq only; AdamW's per-parameter `step` scalars are the "step B" column,
  excluded from the ratio. ZeRO-1 partitions whole parameters across ranks (greedy by size), so
  its largest partition can exceed 8 Psi / N; FSDP2 shards every parameter on dim 0.
With N = 1 there is no data-parallel wrapper and every stage holds everything."""


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="small", help="model preset (tiny or small on CPU)")
    parser.add_argument(
        "--world-sizes",
        type=lambda s: [int(n) for n in s.split(",")],
        default=[1, 2, 4],
        help="comma-separated world sizes, one torchrun launch each",
    )
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--out", default="benchmarks/results/memory.json", help="JSON output")
    # Set by the launcher for its workers: a directory every rank shares.
    parser.add_argument("--run-dir", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def make_config(args: argparse.Namespace, stage: int, world_size: int, run_dir: Path) -> Config:
    return bench_config(
        run_dir,
        device="cpu",
        preset=args.preset,
        micro_batch_size=args.micro_batch_size,
        seq_len=args.seq_len,
        global_batch_size=args.micro_batch_size * world_size,
        steps=2,
        max_bytes=CORPUS_BYTES,
        parallel__zero_stage=stage,
    )


def local_bytes(t: torch.Tensor) -> int:
    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


def optimizer_bytes(optimizers: list[torch.optim.Optimizer]) -> tuple[int, int]:
    """(bytes of Adam moments, bytes of `step` scalars) this rank holds."""
    moments = steps = 0
    for optimizer in optimizers:
        inner = optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer
        for state in inner.state.values():
            moments += sum(local_bytes(state[k]) for k in MOMENTS)
            steps += local_bytes(state["step"])
    return moments, steps


def measure(trainer: Trainer) -> dict[str, int]:
    """One training step, then this rank's bytes of params, grads and optimizer state."""
    trainer.train_step(trainer.loader.next_batch())
    params = trainer.model.parameters()
    param_bytes = sum(local_bytes(p) for p in params)
    moments, steps = optimizer_bytes(trainer.optimizers.per_part)
    trainer.model.forward_backward(trainer.loader.next_batch(), trainer.optimizers.scale)
    grad_bytes = sum(local_bytes(p.grad) for p in params if p.grad is not None)
    trainer.optimizers.zero_grad()
    return {"params": param_bytes, "grads": grad_bytes, "optimizer": moments, "step": steps}


def theory(psi: int, stage: int, n: int) -> dict[str, float]:
    """The ZeRO paper's bytes per rank for fp32 AdamW."""
    return {
        "params": 4 * psi / (n if stage >= 3 else 1),
        "grads": 4 * psi / (n if stage >= 2 else 1),
        "optimizer": 8 * psi / (n if stage >= 1 else 1),
    }


def worker(args: argparse.Namespace) -> None:
    run_dir = Path(args.run_dir)
    rows = []
    with worker_session(run_dir) as (ctx, logger):
        for stage in STAGES:
            cfg = make_config(args, stage, ctx.world_size, run_dir / f"stage{stage}")
            Path(cfg.run.dir).mkdir(parents=True, exist_ok=True)
            trainer = trainer_for(cfg, ctx, logger)
            try:
                mine = measure(trainer)
                psi = num_params(trainer.plan.model)
            finally:
                trainer.close()
            del trainer
            gc.collect()
            per_rank: list[dict[str, int]] = [{} for _ in range(ctx.world_size)]
            dist.all_gather_object(per_rank, mine)
            rows.append(
                {
                    "world_size": ctx.world_size,
                    "zero_stage": stage,
                    "psi": psi,
                    "per_rank": per_rank,
                }
            )
        if ctx.rank == 0:
            (run_dir / f"world{ctx.world_size}.json").write_text(json.dumps(rows))


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Largest per-rank value of each kind, the theory beside it, and their ratio."""
    for row in rows:
        expected = theory(row["psi"], row["zero_stage"], row["world_size"])
        for kind in ("params", "grads", "optimizer", "step"):
            row[kind] = max(r[kind] for r in row["per_rank"])
        for kind, value in expected.items():
            row[f"{kind}_theory"] = value
            row[f"{kind}_ratio"] = row[kind] / value
    return rows


def report(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    mib = 2**20
    psi = rows[0]["psi"]
    print(
        f"\nper-rank memory after one step: preset {args.preset} (Psi = {psi:,} parameters), "
        f"fp32 AdamW, CPU/gloo; MiB measured (max over ranks) / ZeRO-paper theory = ratio"
    )
    header = (
        f"{'N':>2} {'stage':>5}  {'params MiB':>22}  {'grads MiB':>22}  "
        f"{'optimizer MiB':>22}  {'step B':>6}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        cells = [
            f"{r[k] / mib:7.2f} /{r[f'{k}_theory'] / mib:7.2f} ={r[f'{k}_ratio']:5.2f}"
            for k in ("params", "grads", "optimizer")
        ]
        print(
            f"{r['world_size']:>2} {r['zero_stage']:>5}  " + "  ".join(cells) + f"  {r['step']:>6}"
        )
    print(FOOTER)
    result = {
        "config": {
            "preset": args.preset,
            "psi": psi,
            "world_sizes": args.world_sizes,
            "micro_batch_size": args.micro_batch_size,
            "seq_len": args.seq_len,
            "backend": "gloo",
            "dtype": "fp32",
            "optimizer": "AdamW (step scalars in 'step', excluded from 'optimizer')",
            "measured_value": "max over ranks; per_rank holds every rank's bytes",
            "torch": torch.__version__,
        },
        "rows": rows,
    }
    write_json(args.out, result)


def launch(argv: list[str], args: argparse.Namespace) -> None:
    """One torchrun launch per world size, sharing a temporary directory; then the report."""
    run_dir = Path(tempfile.mkdtemp(prefix="distrain-memory-"))
    try:
        rows = []
        for n in args.world_sizes:
            (run_dir / f"world{n}").mkdir()
            launch_ranks(__file__, n, argv, run_dir=str(run_dir / f"world{n}"))
            rows += json.loads((run_dir / f"world{n}" / f"world{n}.json").read_text())
        report(args, summarize(rows))
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def main() -> None:
    argv = sys.argv[1:]
    args = parse_args(argv)
    if is_worker():
        worker(args)
    else:
        launch(argv, args)


if __name__ == "__main__":
    main()
