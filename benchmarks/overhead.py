"""Framework overhead: distrain's training step against a minimal hand-written PyTorch DDP loop.

Both sides train the same "tiny" GPT (same ModelArgs, same seeded init) on identical micro-batches
on 2 ranks over gloo (CPU). The distrain side is a real `Trainer` whose step is timed exactly as
`Trainer.run` calls it: the learning-rate computation, `loader.next_batch()` and `train_step`. The
hand-written side is what a user would write: DDP over the default group, AdamW(foreach=True),
cross-entropy, no_sync on all but the last micro-batch, clip_grad_norm_, step, zero_grad.

Blocks of K steps of each side are interleaved (R rounds; the side that goes first alternates
between rounds) so machine noise hits both alike. Each block starts after a barrier and its time is
the slowest rank's (all_reduce MAX). The reported step time is the median over blocks of
block time / K, and the ratio is distrain / hand-written (target <= 1.03). Since both sides train
the same model on the same data with the same schedule, their per-step losses must agree: the
largest difference is reported as a check that both did the same work.

Run from the repository root (the script launches its own 2 ranks through torchrun's API):

    python3 benchmarks/overhead.py                       # defaults: 8 rounds x 10 steps, accum 1
    python3 benchmarks/overhead.py --accum-list 1,4      # one row per accumulation count

Rank 0 prints a table and writes JSON to --out (default benchmarks/results/overhead.json).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from harness import bench_config, is_worker, launch_self, trainer_for, worker_session, write_json
from torch.nn.parallel import DistributedDataParallel

from distrain.config.schema import Config
from distrain.data import DistributedBatchLoader, TokenDataset
from distrain.models.decoder.model import Decoder, init_weights
from distrain.optim.schedule import lr_at
from distrain.parallel.device import DistContext
from distrain.train.loop import Trainer

NUM_RANKS = 2
PRESET = "tiny"
# The corpus is only a source of token windows here; a 2 MB prefix of the default one holds far
# more samples than any run of this benchmark reads, and loads in a fraction of the full time.
CORPUS_BYTES = 2_000_000

Step = Callable[[], torch.Tensor]


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps-per-block", type=int, default=10, help="K: steps per block")
    parser.add_argument("--blocks", type=int, default=8, help="R: blocks of each side")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps of each side first")
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step")
    parser.add_argument(
        "--accum-list",
        type=lambda s: [int(a) for a in s.split(",")],
        help="comma-separated accumulation counts, one table row each (replaces --accum)",
    )
    parser.add_argument("--out", default="benchmarks/results/overhead.json", help="JSON output")
    # Set by the launcher for its workers: a run directory every rank shares.
    parser.add_argument("--run-dir", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def make_config(args: argparse.Namespace, accum: int, run_dir: Path) -> Config:
    return bench_config(
        run_dir,
        device="cpu",
        preset=PRESET,
        micro_batch_size=args.micro_batch_size,
        seq_len=args.seq_len,
        global_batch_size=args.micro_batch_size * NUM_RANKS * accum,
        steps=args.warmup + args.blocks * args.steps_per_block,
        max_bytes=CORPUS_BYTES,
    )


def distrain_step(trainer: Trainer) -> Step:
    """One iteration of `Trainer.run` without its logging, evaluation and checkpoint checks."""

    def step() -> torch.Tensor:
        loss, _, _ = trainer.train_step(trainer.loader.next_batch())
        trainer.step += 1
        return loss

    return step


def handwritten_step(cfg: Config, trainer: Trainer, dataset: TokenDataset) -> Step:
    """The plain DDP loop a user would write, training the model distrain trains, on the same
    batches (its own loader over the same samples) with the same learning-rate schedule."""
    model = Decoder(trainer.plan.model)
    init_weights(model, trainer.plan.model, cfg.training.seed)
    ddp = DistributedDataParallel(model)
    # The decay split distrain uses, so that both sides do the same arithmetic.
    params = list(model.named_parameters())
    decay = [p for n, p in params if p.ndim >= 2 and "emb" not in n]
    no_decay = [p for n, p in params if p.ndim < 2 or "emb" in n]
    o = cfg.optim
    optimizer = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": o.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=o.lr,
        betas=(o.beta1, o.beta2),
        eps=o.eps,
        foreach=True,
    )
    t = cfg.training
    loader = DistributedBatchLoader(
        dataset,
        global_batch_size=t.global_batch_size,
        micro_batch_size=t.micro_batch_size,
        dp_rank=dist.get_rank(),
        dp_size=dist.get_world_size(),
        seed=t.seed,
    )
    step_count = 0

    def step() -> torch.Tensor:
        nonlocal step_count
        batches = loader.next_batch()
        loss_sum = torch.zeros(())
        for i, (inputs, targets) in enumerate(batches):
            sync = contextlib.nullcontext() if i == len(batches) - 1 else ddp.no_sync()
            with sync:
                logits = ddp(inputs)
                loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
                (loss / len(batches)).backward()
            loss_sum += loss.detach()
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), o.max_grad_norm, foreach=True)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step_count, cfg=o, total_steps=t.steps)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step_count += 1
        return loss_sum / len(batches)

    return step


def time_block(step: Step, num_steps: int) -> tuple[float, list[torch.Tensor]]:
    """Seconds per step of one block, on the slowest rank, and the block's losses."""
    dist.barrier()
    start = time.perf_counter()
    losses = [step() for _ in range(num_steps)]
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item() / num_steps, losses


def measure(
    args: argparse.Namespace, accum: int, ctx: DistContext, logger: Any, run_dir: Path
) -> dict[str, Any]:
    """Warm both sides up, then time `args.blocks` interleaved rounds of both at this accum."""
    cfg = make_config(args, accum, run_dir / f"accum{accum}")
    Path(cfg.run.dir).mkdir(parents=True, exist_ok=True)
    trainer = trainer_for(cfg, ctx, logger)
    try:
        sides = {
            "distrain": distrain_step(trainer),
            "handwritten": handwritten_step(cfg, trainer, trainer.loader.dataset),
        }
        losses: dict[str, list[torch.Tensor]] = {name: [] for name in sides}
        for name, step in sides.items():
            losses[name] += [step() for _ in range(args.warmup)]
        per_block: dict[str, list[float]] = {name: [] for name in sides}
        for round_ in range(args.blocks):
            order = list(sides) if round_ % 2 == 0 else list(reversed(sides))
            for name in order:
                step_s, block_losses = time_block(sides[name], args.steps_per_block)
                per_block[name].append(step_s)
                losses[name] += block_losses
    finally:
        trainer.close()
    diff = (torch.stack(losses["distrain"]) - torch.stack(losses["handwritten"])).abs().max()
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    step_s = {name: statistics.median(times) for name, times in per_block.items()}
    tokens_per_step = cfg.training.global_batch_size * cfg.training.seq_len
    return {
        "accum": accum,
        "distrain_step_s": step_s["distrain"],
        "handwritten_step_s": step_s["handwritten"],
        "ratio": step_s["distrain"] / step_s["handwritten"],
        "distrain_tokens_per_s": tokens_per_step / step_s["distrain"],
        "handwritten_tokens_per_s": tokens_per_step / step_s["handwritten"],
        "max_loss_diff": diff.item(),
        "per_block": per_block,
    }


def report(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    """Print the table and write the JSON (rank 0 only)."""
    print(
        f"\ndistrain vs hand-written DDP: preset {PRESET}, {NUM_RANKS} ranks (gloo, CPU), "
        f"micro-batch {args.micro_batch_size} x {args.seq_len} tokens, "
        f"{args.blocks} interleaved blocks x {args.steps_per_block} steps per side, "
        "median over blocks, slowest rank"
    )
    header = (
        f"{'accum':>5}  {'distrain ms':>11}  {'hand ms':>9}  {'ratio':>6}  "
        f"{'distrain tok/s':>14}  {'hand tok/s':>10}  {'max |dloss|':>11}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['accum']:>5}  {r['distrain_step_s'] * 1e3:>11.2f}  "
            f"{r['handwritten_step_s'] * 1e3:>9.2f}  {r['ratio']:>6.3f}  "
            f"{r['distrain_tokens_per_s']:>14,.0f}  {r['handwritten_tokens_per_s']:>10,.0f}  "
            f"{r['max_loss_diff']:>11.1e}"
        )
    config = {
        "preset": PRESET,
        "num_ranks": NUM_RANKS,
        "backend": "gloo",
        "steps_per_block": args.steps_per_block,
        "blocks": args.blocks,
        "warmup": args.warmup,
        "micro_batch_size": args.micro_batch_size,
        "seq_len": args.seq_len,
        "accum": [r["accum"] for r in rows],
        "torch": torch.__version__,
        "omp_num_threads": torch.get_num_threads(),
    }
    # Top-level results are the first accumulation count's; by_accum holds every row.
    first = rows[0]
    result = {
        "config": config,
        "distrain_step_s": first["distrain_step_s"],
        "handwritten_step_s": first["handwritten_step_s"],
        "ratio": first["ratio"],
        "per_block": first["per_block"],
        "by_accum": rows,
    }
    write_json(args.out, result)


def worker(args: argparse.Namespace) -> None:
    run_dir = Path(args.run_dir)
    with worker_session(run_dir) as (ctx, logger):
        rows = [
            measure(args, accum, ctx, logger, run_dir) for accum in args.accum_list or [args.accum]
        ]
        if ctx.rank == 0:
            report(args, rows)


def main() -> None:
    argv = sys.argv[1:]
    args = parse_args(argv)
    if is_worker():
        worker(args)
    else:
        launch_self(__file__, NUM_RANKS, argv, name="overhead")


if __name__ == "__main__":
    main()
