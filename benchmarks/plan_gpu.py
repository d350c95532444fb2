"""The planner's memory per device against a real GPU's allocator.

Two halves, because the GPU machine and the planner's fake builds need not be the same machine:

- `--measure` (on a CUDA machine): for each row (preset x activation checkpointing x
  micro-batch; one device, bf16, ZeRO 0, seq --seq-len), a real distrain `Trainer` takes --steps
  steps; the row's peak is `torch.cuda.max_memory_allocated` over those steps (the first creates
  the optimizer state), next to `max_memory_reserved` (what the caching allocator holds). A row
  that runs out of memory is kept as such. Writes --out (default
  benchmarks/results/plan_gpu-measured.json).
- `--compare MEASURED` (anywhere): prices every measured row as `distrain plan` does: the
  memory model (distrain/plan/memory_model.py, calibrated by its shallow fake builds) and the
  full fake build (`--exhaustive`), and writes each one's error against the GPU's peak
  (predicted / measured - 1) to --out (default benchmarks/results/plan_gpu.json). A row without
  `allocated_peak` (measured where there was no CUDA: benchmarks/gpu.sh --dry-run) is priced
  only, its errors null.

    python3 benchmarks/plan_gpu.py --measure            # on the GPU machine
    python3 benchmarks/plan_gpu.py --compare benchmarks/results/plan_gpu-measured.json
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
from harness import bench_config, is_worker, launch_self, trainer_for, worker_session, write_json

from distrain.config.schema import Config
from distrain.models.registry import family_of_preset
from distrain.plan.built_rows import memory_of, memory_row
from distrain.plan.memory_model import calibrate_family, calibration_builds, modelled_row
from distrain.plan.search import candidate_plan
from distrain.plan.timing import Candidate

PRESETS = ("qwen3-0.6b", "llama3-1b", "1b")
CHECKPOINTING = ("none", "full")
MICRO_BATCHES = (1, 4)
CORPUS_BYTES = 2_000_000


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--measure", action="store_true", help="Measure the rows on this GPU.")
    mode.add_argument("--compare", metavar="MEASURED", help="Price a measured JSON's rows.")
    p.add_argument("--presets", default=",".join(PRESETS))
    p.add_argument("--checkpointing", default=",".join(CHECKPOINTING))
    p.add_argument("--micro-batches", default=",".join(map(str, MICRO_BATCHES)))
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out")
    p.add_argument("--run-dir", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def rows_of(args: argparse.Namespace) -> list[tuple[str, str, int]]:
    return list(
        itertools.product(
            args.presets.split(","),
            args.checkpointing.split(","),
            [int(m) for m in args.micro_batches.split(",")],
        )
    )


def row_config(run_dir: str, preset: str, ac: str, mb: int, seq_len: int, steps: int) -> Config:
    return bench_config(
        run_dir,
        preset=preset,
        micro_batch_size=mb,
        seq_len=seq_len,
        global_batch_size=mb,
        steps=steps,
        max_bytes=CORPUS_BYTES,
        model__family=family_of_preset(preset) or "gpt",
        training__precision="bf16",
        training__compile=False,
        training__activation_checkpointing=ac,
        parallel__zero_stage=0,
    )


def measure_row(cfg: Config, ctx: Any, logger: Any) -> dict[str, Any]:
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(ctx.device)
    trainer = trainer_for(cfg, ctx, logger)
    try:
        for _ in range(cfg.training.steps):
            trainer.train_step(trainer.loader.next_batch(), report_loss=False)
            trainer.step += 1
        torch.cuda.synchronize(ctx.device)
        return {
            "allocated_peak": torch.cuda.max_memory_allocated(ctx.device),
            "reserved_peak": torch.cuda.max_memory_reserved(ctx.device),
        }
    finally:
        trainer.close()
        del trainer
        gc.collect()
        torch.cuda.empty_cache()


def measure(args: argparse.Namespace) -> None:
    run_dir = Path(args.run_dir)
    rows = []
    with worker_session(run_dir, "cuda") as (ctx, logger):
        for preset, ac, mb in rows_of(args):
            cfg = row_config(str(run_dir / preset), preset, ac, mb, args.seq_len, args.steps)
            Path(cfg.run.dir).mkdir(parents=True, exist_ok=True)
            row: dict[str, Any] = {"preset": preset, "checkpointing": ac, "micro_batch_size": mb}
            try:
                row.update(measure_row(cfg, ctx, logger))
            except torch.OutOfMemoryError:
                row["out_of_memory"] = True
            gib = row.get("allocated_peak", 0) / 2**30
            print(f"{preset:<11} ac {ac:<4} mb {mb}  peak {gib:7.2f} GiB", flush=True)
            rows.append(row)
        result = {
            "config": {
                "seq_len": args.seq_len,
                "steps": args.steps,
                "precision": "bf16",
                "zero_stage": 0,
                "device": torch.cuda.get_device_name(ctx.device),
                "torch": torch.__version__,
            },
            "rows": rows,
        }
        write_json(args.out or "benchmarks/results/plan_gpu-measured.json", result)


def compare(args: argparse.Namespace) -> None:
    measured = json.loads(Path(args.compare).read_text())
    seq_len = measured["config"]["seq_len"]
    rows: list[dict[str, Any]] = []
    caches: dict[str, dict] = {}  # per preset: the search's build caches are keyed by layout
    coefficients: dict[tuple[str, Any], Any] = {}
    for m in measured["rows"]:
        row = dict(m)
        if m.get("out_of_memory"):
            rows.append(row)
            continue
        preset, ac, mb = m["preset"], m["checkpointing"], m["micro_batch_size"]
        base = row_config("unused", preset, ac, mb, seq_len, 1)
        base.run.device = "cpu"
        run = candidate_plan(base, Candidate(1, 1, 1, 1, 0, ac, mb), 1)
        cfg = run.config
        cache = caches.setdefault(preset, {})

        def coefficients_of(family, preset=preset, base=base, cache=cache):  # noqa: ANN001, ANN202
            if (preset, family) not in coefficients:
                build = lambda b: memory_of(b, cache)  # noqa: E731
                builds = calibration_builds(base, family)
                coefficients[preset, family] = calibrate_family(family, builds, build)
            return coefficients[preset, family]

        modelled = modelled_row(
            1,
            coefficients_of,
            model=cfg.model,
            parallel=cfg.parallel,
            training=cfg.training,
            optim=cfg.optim,
        )["peak"]
        built = memory_row(run, cache, exhaustive=True)["peak"]
        row.update(modelled_peak=modelled, built_peak=built)
        if "allocated_peak" not in m:
            row.update(modelled_error=None, built_error=None)
            print(
                f"{preset:<11} ac {ac:<4} mb {mb}  no GPU peak  modelled "
                f"{modelled / 2**30:7.2f} GiB  built {built / 2**30:7.2f} GiB",
                flush=True,
            )
            rows.append(row)
            continue
        row["modelled_error"] = modelled / m["allocated_peak"] - 1
        row["built_error"] = built / m["allocated_peak"] - 1
        print(
            f"{preset:<11} ac {ac:<4} mb {mb}  GPU {m['allocated_peak'] / 2**30:7.2f} GiB  "
            f"modelled {row['modelled_error']:+.1%}  built {row['built_error']:+.1%}",
            flush=True,
        )
        rows.append(row)
    errors = [abs(r["modelled_error"]) for r in rows if r.get("modelled_error") is not None]
    result = {
        "config": measured["config"],
        "measured_record": measured["record"],
        "rows": rows,
        "summary": {
            "rows": len(errors),
            "within_5_percent": sum(e <= 0.05 for e in errors),
            "median_abs_error": statistics.median(errors) if errors else None,
            "max_abs_error": max(errors) if errors else None,
        },
    }
    write_json(args.out or "benchmarks/results/plan_gpu.json", result)


def main() -> None:
    argv = sys.argv[1:]
    args = parse_args(argv)
    if args.compare:
        compare(args)
    elif is_worker():
        measure(args)
    else:
        launch_self(__file__, 1, argv, name="plan-gpu")


if __name__ == "__main__":
    main()
