"""Training stall caused by a checkpoint save: synchronous against asynchronous, as a ratio.

Two real distrain `Trainer`s train the same model on 2 ranks over gloo (CPU), one with
`checkpoint.async_mode = "none"`, one with `"async"`, each saving into its own temporary directory.
Checkpoint intervals are off and nothing saves at the end: this script alone decides when to save.
After W untimed warmup steps of each, R rounds run; in each round both modes (the one that goes
first alternates between rounds) time two blocks, each after a barrier, each the slowest rank's
time (all_reduce MAX):

- baseline: K training steps, no save; baseline step time = block time / K;
- save: one step, `trainer.save_checkpoint("temporary")`, K more steps, then
  `trainer.checkpointer.wait()` (the in-flight async save finishes and commits there, so whatever
  it still costs counts; sync saves commit inside the save call and the wait is nearly free).

stall = save block time - (K + 1) x baseline step time: the wall time the save added to training.
The table shows per mode the median stall over rounds, the median time the save call blocked the
training loop, the median wait() time, the median baseline step time and the size of one
checkpoint (all ranks' files, from its manifest); then the ratio async / sync of median stalls.

Limits: on CPU, async staging is an in-memory copy of the whole state (on GPU it is a device-to-host
copy), so the save call still blocks for that copy. With 2 ranks on a 2-core machine the background
writer thread competes with training for CPU, which inflates the async stall here compared to a GPU
machine, where the writer uses host cores the training loop leaves idle. Writes go to a local temp
dir (page cache), so storage bandwidth is hardly measured.

Run from the repository root (the script launches its own 2 ranks through torchrun's API):

    python3 benchmarks/checkpoint.py                  # preset small, 5 rounds x 4 steps
    python3 benchmarks/checkpoint.py --preset tiny --rounds 8

Rank 0 prints a table and writes JSON to --out (default benchmarks/results/checkpoint.json).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from harness import is_worker, launch_self, worker_session, write_json

from distrain.checkpoint.manifest import committed
from distrain.config.schema import Config, validate
from distrain.optim.schedule import lr_at
from distrain.parallel.device import DistContext
from distrain.train.build import build_trainer
from distrain.train.loop import Trainer

NUM_RANKS = 2
MODES = ("none", "async")
# The corpus only supplies token windows; a 2 MB prefix of the default one is plenty.
CORPUS_BYTES = 2_000_000
# Timed quantities of one round, reduced with MAX over ranks in this order.
FIELDS = ("baseline_s", "save_block_s", "save_call_s", "wait_s")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="small", help="model preset (tiny or small on CPU)")
    parser.add_argument("--warmup", type=int, default=3, help="W: untimed steps of each mode")
    parser.add_argument("--rounds", type=int, default=5, help="R: rounds of each mode")
    parser.add_argument("--steps", type=int, default=4, help="K: steps per baseline block")
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--out", default="benchmarks/results/checkpoint.json", help="JSON output")
    # Set by the launcher for its workers: a directory every rank shares.
    parser.add_argument("--run-dir", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def make_config(args: argparse.Namespace, mode: str, run_dir: Path) -> Config:
    cfg = Config()
    cfg.run.dir = str(run_dir)
    cfg.run.device = "cpu"
    cfg.model.preset = args.preset
    cfg.data.max_bytes = CORPUS_BYTES
    t = cfg.training
    t.micro_batch_size = args.micro_batch_size
    t.seq_len = args.seq_len
    t.global_batch_size = args.micro_batch_size * NUM_RANKS
    t.steps = args.warmup + args.rounds * (2 * args.steps + 1)
    cfg.metrics.progress_bar = False
    cfg.metrics.tensorboard = False
    c = cfg.checkpoint
    c.async_mode = mode
    c.at_end = False
    c.interval_steps = 0
    c.interval_minutes = 0.0
    c.permanent_every_steps = 0
    c.permanent_every_minutes = 0.0
    validate(cfg)
    return cfg


def train(trainer: Trainer, num_steps: int) -> None:
    """`num_steps` iterations of `Trainer.run`'s step, without its logging and checks."""
    cfg = trainer.cfg
    for _ in range(num_steps):
        lr = lr_at(trainer.step, cfg=cfg.optim, total_steps=cfg.training.steps)
        trainer.train_step(trainer.loader.next_batch(), lr)
        trainer.step += 1


def time_round(trainer: Trainer, k: int) -> dict[str, float]:
    """One baseline block and one save block; each time is the slowest rank's."""
    dist.barrier()
    start = time.perf_counter()
    train(trainer, k)
    baseline = time.perf_counter() - start

    dist.barrier()
    start = time.perf_counter()
    train(trainer, 1)
    call_start = time.perf_counter()
    trainer.save_checkpoint("temporary")
    save_call = time.perf_counter() - call_start
    train(trainer, k)
    wait_start = time.perf_counter()
    trainer.checkpointer.wait()
    end = time.perf_counter()

    times = torch.tensor([baseline, end - start, save_call, end - wait_start], dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return dict(zip(FIELDS, times.tolist(), strict=True))


def checkpoint_bytes(trainer: Trainer) -> int:
    """Bytes of the newest committed checkpoint, all ranks' files (from its manifest)."""
    newest = committed(trainer.checkpointer.storage)[-1]
    return sum(info["size"] for info in newest.manifest["files"].values())


def summarize(mode: str, rounds: list[dict[str, float]], k: int, size: int) -> dict[str, Any]:
    step_s = [r["baseline_s"] / k for r in rounds]
    stall_s = [r["save_block_s"] - (k + 1) * s for r, s in zip(rounds, step_s, strict=True)]
    return {
        "mode": mode,
        "stall_s": statistics.median(stall_s),
        "save_call_s": statistics.median(r["save_call_s"] for r in rounds),
        "wait_s": statistics.median(r["wait_s"] for r in rounds),
        "baseline_step_s": statistics.median(step_s),
        "checkpoint_bytes": size,
        "per_round": {
            "stall_s": stall_s,
            "baseline_step_s": step_s,
            **{field: [r[field] for r in rounds] for field in FIELDS},
        },
    }


def measure(
    args: argparse.Namespace, ctx: DistContext, logger: Any, run_dir: Path
) -> list[dict[str, Any]]:
    """Warm both modes up, then time `args.rounds` interleaved rounds of each."""
    trainers: dict[str, Trainer] = {}
    try:
        for mode in MODES:
            cfg = make_config(args, mode, run_dir / mode)
            Path(cfg.run.dir).mkdir(parents=True, exist_ok=True)
            trainers[mode] = build_trainer(cfg, ctx, logger)
        for trainer in trainers.values():
            train(trainer, args.warmup)
        rounds: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
        for round_ in range(args.rounds):
            order = MODES if round_ % 2 == 0 else tuple(reversed(MODES))
            for mode in order:
                rounds[mode].append(time_round(trainers[mode], args.steps))
        return [
            summarize(mode, rounds[mode], args.steps, checkpoint_bytes(trainers[mode]))
            for mode in MODES
        ]
    finally:
        for trainer in trainers.values():
            trainer.close()


def report(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    """Print the table and write the JSON (rank 0 only)."""
    print(
        f"\ncheckpoint stall: preset {args.preset}, {NUM_RANKS} ranks (gloo, CPU), micro-batch "
        f"{args.micro_batch_size} x {args.seq_len} tokens, {args.rounds} interleaved rounds x "
        f"(save + {args.steps} steps) per mode, median over rounds, slowest rank"
    )
    header = (
        f"{'mode':>5}  {'stall ms':>9}  {'save call ms':>12}  {'wait ms':>8}  "
        f"{'step ms':>8}  {'ckpt MB':>8}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['mode']:>5}  {r['stall_s'] * 1e3:>9.1f}  {r['save_call_s'] * 1e3:>12.1f}  "
            f"{r['wait_s'] * 1e3:>8.1f}  {r['baseline_step_s'] * 1e3:>8.1f}  "
            f"{r['checkpoint_bytes'] / 1e6:>8.1f}"
        )
    by_mode = {r["mode"]: r for r in rows}
    ratio = by_mode["async"]["stall_s"] / by_mode["none"]["stall_s"]
    print(f"stall ratio async / sync: {ratio:.3f}")
    print(
        "stall = save block - (K+1) x baseline step; save call = time save_checkpoint blocked; "
        "wait = checkpointer.wait() after the K steps (inside the stall); MB = 10^6 bytes"
    )
    result = {
        "config": {
            "preset": args.preset,
            "num_ranks": NUM_RANKS,
            "backend": "gloo",
            "device": "cpu",
            "warmup": args.warmup,
            "rounds": args.rounds,
            "steps_per_block": args.steps,
            "micro_batch_size": args.micro_batch_size,
            "seq_len": args.seq_len,
            "measured_value": "max over ranks per block; median over rounds",
            "torch": torch.__version__,
            "omp_num_threads": torch.get_num_threads(),
            "cpu_count": os.cpu_count(),
        },
        "stall_ratio_async_over_sync": ratio,
        "modes": rows,
    }
    write_json(args.out, result)


def worker(args: argparse.Namespace) -> None:
    run_dir = Path(args.run_dir)
    with worker_session(run_dir) as (ctx, logger):
        rows = measure(args, ctx, logger, run_dir)
        if ctx.rank == 0:
            report(args, rows)


def main() -> None:
    argv = sys.argv[1:]
    args = parse_args(argv)
    if is_worker():
        worker(args)
    else:
        launch_self(__file__, NUM_RANKS, argv, name="checkpoint")


if __name__ == "__main__":
    main()
