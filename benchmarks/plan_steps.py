"""Predicted vs measured step time and model-state memory of small layouts on this machine
(`benchmarks/plan.py --measure`; not a test).

Layouts (preset tiny: dim 128, 4 layers; seq 64, global batch 8, micro-batch 2, fp32): 1 rank,
dp2 DDP, ZeRO-3 x2, tp2, pp2 1f1b. Measured: a real `Trainer` per layout, the 2-rank ones built
together in one 2-rank launch and timed with harness.measure_steps in rounds that visit them in
turn; after each round rank 0 starts a fresh process (rank 1 waits) that measures the 1-rank
layout the same way and then probes every layout, so that measurements and probes of each round
share the machine's load of that moment. Each figure is the median over rounds of seconds per
step. Every rank and the probe run one intra-op thread (OMP_NUM_THREADS=1, torchrun's default
for several ranks). Predicted: distrain/plan/probe.py (the rank's real step timed on one process
under a fake process group, plus the collectives it issues priced by the calibrated alpha-beta
costs; the 2-rank layouts probed by 2 processes at once, probe_together), after `distrain plan
--calibrate`'s measurement (run here unless --no-calibrate). The
wall/cpu column (seconds per step over the CPU seconds rank 0 spent in it) says how loaded the
machine was. Memory: parameters + optimizer state per rank at rest after the timed steps, against
the fake-tensor plan (distrain/plan/search.py memory_of; the pipeline row
distrain/plan/pipeline_memory.py).

A row passes when predicted / measured step time is within 25%; the script exits 1 if any fails.
The plan ranks the layouts by predicted time; the check is that the measured-fastest is first or
second.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist
from harness import is_worker, launch_self, measure_steps, trainer_for, worker_session, write_json

from distrain.config.schema import Config
from distrain.plan.memory import held_optimizer_state_bytes, local_bytes
from distrain.plan.pipeline_memory import estimate_pipeline_memory
from distrain.plan.planned import planned_run

LAYOUTS: list[tuple[str, int, dict[str, Any]]] = [
    ("1 rank", 1, {}),
    ("dp2 DDP", 2, {}),
    ("ZeRO-3 x2", 2, {"zero_stage": 3}),
    ("tp2", 2, {"tp": 2}),
    ("pp2 1f1b", 2, {"pp": 2, "pp_schedule": "1f1b"}),
]
TOLERANCE = 0.25


def layout_config(parallel: dict[str, Any], *, steps: int = 1, run_dir: str = "") -> Config:
    cfg = Config()
    cfg.run.device = "cpu"
    cfg.run.dir = run_dir
    cfg.model.preset = "tiny"
    cfg.data.max_bytes = 2_000_000
    t = cfg.training
    t.seq_len, t.global_batch_size, t.micro_batch_size, t.precision = 64, 8, 2, "fp32"
    t.steps = steps
    for key, value in parallel.items():
        setattr(cfg.parallel, key, value)
    cfg.metrics.progress_bar = False
    cfg.metrics.tensorboard = False
    cfg.checkpoint.at_end = False
    cfg.checkpoint.interval_steps = 0
    return cfg


def _trainer(par: dict[str, Any], ctx: Any, logger: Any, run_dir: Path) -> Any:
    cfg = layout_config(par, steps=1000, run_dir=str(run_dir))
    cfg.validate()
    run_dir.mkdir(parents=True, exist_ok=True)
    return trainer_for(cfg, ctx, logger)


def _model_state(trainer: Any) -> int:
    params = sum(local_bytes(p) for p in trainer.model.parameters())
    return params + held_optimizer_state_bytes(trainer.optimizers.per_part)


def worker(ns: argparse.Namespace) -> None:
    """The 2-rank layouts, measured in rounds; after each round rank 0 runs `side` in a fresh
    process (the 1-rank layout measured, then every layout probed) while rank 1 waits."""
    run_dir = Path(ns.run_dir)
    chosen = [(name, par) for name, world, par in LAYOUTS if world == 2]
    rounds: dict[str, list[float]] = {name: [] for name, _, _ in LAYOUTS}
    cpu: dict[str, list[float]] = {name: [] for name, _, _ in LAYOUTS}
    probes: dict[str, list[dict]] = {name: [] for name, _, _ in LAYOUTS}
    with worker_session(run_dir) as (ctx, logger):
        trainers = [
            _trainer(par, ctx, logger, run_dir / str(i)) for i, (_, par) in enumerate(chosen)
        ]
        try:
            for trainer in trainers:
                measure_steps(trainer, warmup=0, steps=2, device=ctx.device)
            for r in range(ns.rounds):
                for (name, _), trainer in zip(chosen, trainers, strict=True):
                    start = time.process_time()
                    seconds = measure_steps(trainer, warmup=0, steps=ns.steps, device=ctx.device)
                    rounds[name].append(seconds / ns.steps)
                    cpu[name].append((time.process_time() - start) / ns.steps)
                if ctx.rank == 0:
                    side_out = run_dir / f"side{r}.json"
                    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV}
                    subprocess.run(
                        [
                            sys.executable,
                            __file__,
                            "--side",
                            str(side_out),
                            "--steps",
                            str(ns.steps),
                        ],
                        env=env,
                        check=True,
                    )
                    side_rows = json.loads(side_out.read_text())
                    rounds["1 rank"].append(side_rows["measured_s"])
                    cpu["1 rank"].append(side_rows["cpu_s"])
                    cpu.setdefault("probe", []).append(side_rows["probe_load"])
                    one_rank_state = side_rows["model_state_bytes"]
                    for name, found in side_rows["probes"].items():
                        probes[name].append(found)
                dist.barrier()
            states = {name: _model_state(t) for (name, _), t in zip(chosen, trainers, strict=True)}
            if ctx.rank == 0:
                states["1 rank"] = one_rank_state
        finally:
            for trainer in trainers:
                trainer.close()
    if ctx.rank == 0:
        result = {"rounds_s": rounds, "cpu_s": cpu, "probes": probes, "model_state_bytes": states}
        write_json(ns.out, result)


# What torchrun puts in a worker's environment: a side process must form its own group.
TORCHRUN_ENV = {
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "ROLE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
}


def side(out: Path, steps: int) -> None:
    """The 1-rank layout measured (one process, its own group), then every layout probed."""
    from distrain.plan.probe import probe, probe_together

    run_dir = out.parent / (out.stem + "-run")
    ((name, _, par),) = [layout for layout in LAYOUTS if layout[1] == 1]
    with worker_session(run_dir) as (ctx, logger):
        trainer = _trainer(par, ctx, logger, run_dir)
        try:
            measure_steps(trainer, warmup=0, steps=2, device=ctx.device)
            start = time.process_time()
            seconds = measure_steps(trainer, warmup=0, steps=steps, device=ctx.device)
            cpu_s = (time.process_time() - start) / steps
            state = _model_state(trainer)
        finally:
            trainer.close()
        del trainer
    # The 1-rank layout probed here, alone; the 2-rank ones by 2 processes at once, as the
    # machine runs their 2 ranks (probe_together).
    found = {name: dataclasses.asdict(probe(planned_run(layout_config(par), 1), repeats=3))}
    wall, cpu = time.perf_counter(), _cpu_seconds()
    jobs = [planned_run(layout_config(par), world) for _, world, par in LAYOUTS if world == 2]
    together = probe_together(jobs, 2, repeats=3)
    names = [name for name, world, _ in LAYOUTS if world == 2]
    found.update({n: dataclasses.asdict(p) for n, p in zip(names, together, strict=True)})
    # Both cores busy: wall x cores in use / CPU seconds.
    load = 2 * (time.perf_counter() - wall) / (_cpu_seconds() - cpu)
    rows = {
        "measured_s": seconds / steps,
        "cpu_s": cpu_s,
        "model_state_bytes": state,
        "probes": found,
        "probe_load": load,
    }
    out.write_text(json.dumps(rows))


def _cpu_seconds() -> float:
    """CPU seconds of this process and its finished children."""
    own, children = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def measure(rounds: int, steps: int) -> dict[str, Any]:
    os.environ["OMP_NUM_THREADS"] = "1"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "steps.json"
        argv = ["--rounds", str(rounds), "--steps", str(steps), "--out", str(out)]
        launch_self(__file__, 2, argv, name="plan-steps")
        return json.loads(out.read_text())


def predict(found: dict[str, Any], costs: dict) -> dict[str, dict[str, Any]]:
    """Per layout: the median over rounds of the predicted step, and the planned model state."""
    from distrain.plan.built_rows import memory_of
    from distrain.plan.probe import Collective, Probe, predicted_time

    predicted = {}
    cache: dict = {}
    for name, world, par in LAYOUTS:
        cfg = layout_config(par)
        tokens = cfg.training.global_batch_size * cfg.training.seq_len
        times = []
        for raw in found["probes"][name]:
            collectives = tuple(Collective(**c) for c in raw.pop("collectives"))
            p = Probe(collectives=collectives, **raw)
            times.append(predicted_time(p, costs, tokens_per_step=tokens).step_s)
        state = None
        if cfg.parallel.pp == 1:
            mem = memory_of(planned_run(cfg, world), cache)
            state = mem.params + mem.optimizer
        else:
            pm = estimate_pipeline_memory(planned_run(cfg, world), rank=0)
            state = pm.params + pm.optimizer
        predicted[name] = {
            "step_s": statistics.median(times),
            "rounds_s": times,
            "model_state_bytes": state,
        }
    return predicted


def report(found: dict[str, Any], predicted: dict[str, dict[str, Any]]) -> bool:
    print(
        f"{'layout':<11}{'pred s':>8}{'meas s':>8}{'ratio':>7}{'pred tok/s':>11}"
        f"{'meas tok/s':>11}{'wall/cpu':>9}  {'state MiB pred/meas':<20} time"
    )
    cfg = layout_config({})
    tokens = cfg.training.global_batch_size * cfg.training.seq_len
    measured = {name: statistics.median(found["rounds_s"][name]) for name, _, _ in LAYOUTS}
    ok = True
    for name, _, _ in LAYOUTS:
        pred_s, meas_s = predicted[name]["step_s"], measured[name]
        ratio = pred_s / meas_s
        passed = abs(ratio - 1) <= TOLERANCE
        ok &= passed
        state = (
            f"{predicted[name]['model_state_bytes'] / 2**20:.2f}/"
            f"{found['model_state_bytes'][name] / 2**20:.2f}"
        )
        print(
            f"{name:<11}{pred_s:8.3f}{meas_s:8.3f}{ratio:7.2f}{tokens / pred_s:11.0f}"
            f"{tokens / meas_s:11.0f}{meas_s / statistics.median(found['cpu_s'][name]):9.2f}"
            f"  {state:<20} {'PASS' if passed else 'FAIL'}"
        )
    by_pred = sorted(predicted, key=lambda n: predicted[n]["step_s"])
    fastest = min(measured, key=measured.__getitem__)
    place = by_pred.index(fastest) + 1
    ranked = place <= 2
    print(
        f"measured fastest: {fastest}; the plan ranks it #{place} of {len(by_pred)} "
        f"({' < '.join(by_pred)}): {'PASS' if ranked else 'FAIL'}"
    )
    print(
        "wall/cpu: seconds per step / CPU seconds per step of the process (rank 0); the probes ran"
        f" at {statistics.median(found['cpu_s']['probe']):.2f}. Near 1 on an idle machine for"
        " compute-bound ranks; far above 1, other jobs held the CPU and the figures are not the"
        " model's."
    )
    return ok and ranked


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3, help="Timed steps per layout per round.")
    parser.add_argument("--no-calibrate", action="store_true", help="Use the stored calibration.")
    parser.add_argument("--side", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", help=argparse.SUPPRESS)
    ns = parser.parse_args(argv)
    if ns.side is not None:
        side(ns.side, ns.steps)
        return 0
    if is_worker():
        worker(ns)
        return 0
    from distrain.plan.calibrate import calibrate, collective_costs, load_calibration

    calibration = load_calibration() if ns.no_calibrate else calibrate()
    costs = collective_costs(calibration)
    if costs is None:
        raise SystemExit("no collective calibration stored: run without --no-calibrate")
    found = measure(ns.rounds, ns.steps)
    predicted = predict(found, costs)
    ok = report(found, predicted)
    write_json("benchmarks/results/plan_steps.json", {"measured": found, "predicted": predicted})
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
