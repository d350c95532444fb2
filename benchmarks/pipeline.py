"""Pipeline bubble, measured: the idle fraction of every pipeline rank under each schedule.

For each schedule of `distrain.parallel.pipeline` (gpipe, 1f1b, interleaved_1f1b, zero_bubble) a
GPT whose per-layer compute dominates communication (default dim 256, 8 layers, 128 tokens,
micro-batch 4, m = 8 microbatches) is cut into stages with `split_model` / `stage_ids_for_rank`
and run by a real `PipelineRunner` on p ranks (gloo, CPU, one thread per rank). After warmup
steps, K steps are timed. For each step:

- wall time: from the end of a barrier to the end of `PipelineRunner.train_step`, the largest over
  ranks (all_reduce MAX), so every rank is judged against the same step;
- busy time of a rank: the seconds it spends computing, summed over its stages and microbatches:
  stage forward (module forward pre-hook to forward hook on each stage module), loss (the loss
  function handed to the runner, timed), and backward (a timer around
  `PipelineStage.backward_maybe_with_nosync`, the one call through which torch runs every kind of
  stage backward: full, input-only (B) and weight-only (W) of the zero-bubble split; module
  backward hooks do not see the deferred W pass). Under zero_bubble torch skips B on stage 0 (its
  input needs no gradient) and runs that stage's whole backward as its W action, recorded as
  "backward_full" in the JSON's per-kind busy times.

Idle fraction of a rank = 1 - sum(busy) / sum(wall) over the K timed steps. Next to it stands the
textbook bubble fraction for p ranks, m microbatches and v stages per rank, assuming equal stage
times and free communication:

- gpipe, 1f1b: (p - 1) / (m + p - 1) (Huang et al. 2019; Narayanan et al. 2021);
- interleaved_1f1b: (p - 1) / (v m + p - 1) (Narayanan et al. 2021, Sec. 2.2);
- zero_bubble (torch's ScheduleInterleavedZeroBubble, the ZB-1P schedule of Qi et al. 2023,
  "Zero Bubble Pipeline Parallelism", arXiv 2401.10241): an estimate, not a proof. Splitting the
  backward into B (input grads) and W (weight grads) lets W fill the cool-down, which in the
  paper's ZB-H1 accounting shrinks 1F1B's bubble (p - 1)(T_F + T_B + T_W) to
  (p - 1)(T_F + T_B - T_W), i.e. to a third when T_F = T_B = T_W. Applied per stage chunk as
  interleaving does, that gives (p - 1) / (3 v m + p - 1). The interleaved_1f1b value is its upper
  bound (both are in the JSON). Near-zero bubbles (ZB-H2, ZB-2P) need more activation memory
  than this schedule keeps.

Limits:
- Communication counts as idle: waiting on send/recv, gloo's copies, and the schedule's own Python
  work (splitting microbatches, scaling grads, stacking losses). So measured idle tends to exceed
  theory even for a perfect schedule; the gap is what the theory leaves out. A rank slower than
  the others (more work, or less CPU) can read below theory: the others wait on it.
- gloo's send/recv run on its own threads; with one core per rank they compete with compute, and
  a send may effectively complete synchronously, which delays the next stage's work.
- The theory assumes equal stages; here the first stage also embeds and the last one also runs
  the output projection and loss (the busy column shows the imbalance).
- --pp 4 on fewer than 4 cores time-shares cores between ranks: "idle" then includes time another
  rank computes, and compute itself slows. Only read per-rank numbers with >= pp cores.
- The B/W split costs compute (two autograd passes per microbatch instead of one), so
  zero_bubble's busy time is higher than interleaved_1f1b's and its step need not be shorter on
  CPU even when its idle fraction is lower.
- The backward timer wraps a torch-internal method (checked to exist at start-up).
- Other load on the machine slows some steps; busy and step time slow together, so the fraction
  suffers less than the milliseconds do, but a rank descheduled between computations reads idle.

Run from the repository root (the script launches its own ranks through torchrun's API):

    python3 benchmarks/pipeline.py                        # p = 2, m = 8, v = 2
    python3 benchmarks/pipeline.py --pp 4 --microbatches 16

Rank 0 prints a table and writes JSON to --out (default benchmarks/results/pipeline.json).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from harness import is_worker, launch_ranks, write_json
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.pipelining import PipelineStage
from torch.utils.hooks import RemovableHandle

from distrain.models.decoder.model import Decoder, ModelArgs, init_weights
from distrain.models.gpt.spec import GPT_SPEC
from distrain.parallel.device import init_distributed
from distrain.parallel.pipeline import SCHEDULES, PipelineRunner, split_model
from distrain.parallel.stages import stage_ids_for_rank

SEED = 1234
SINGLE_STAGE = ("gpipe", "1f1b")
BACKWARD_METHOD = "backward_maybe_with_nosync"
KINDS = ("forward", "loss", "backward_full", "backward_input", "backward_weight")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pp", type=int, choices=(2, 4), default=2, help="pipeline ranks p")
    parser.add_argument("--microbatches", type=int, default=8, help="m: microbatches per step")
    parser.add_argument(
        "--stages-per-rank", type=int, default=2, help="v for interleaved_1f1b and zero_bubble"
    )
    parser.add_argument("--micro-batch-size", type=int, default=4, help="sequences per microbatch")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--n-layers", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per schedule")
    parser.add_argument("--steps", type=int, default=4, help="K: timed steps per schedule")
    parser.add_argument(
        "--schedules",
        type=lambda s: s.split(","),
        default=list(SCHEDULES),
        help="comma-separated schedules",
    )
    parser.add_argument("--out", default="benchmarks/results/pipeline.json", help="JSON output")
    return parser.parse_args(argv)


def model_args(args: argparse.Namespace) -> ModelArgs:
    return ModelArgs(
        vocab_size=256,
        dim=args.dim,
        n_layers=args.n_layers,
        n_heads=args.dim // 64,
        ffn_dim=4 * args.dim,
        max_seq_len=args.seq_len,
    )


def stages_per_rank(schedule: str, args: argparse.Namespace) -> int:
    return 1 if schedule in SINGLE_STAGE else args.stages_per_rank


def theory(schedule: str, p: int, m: int, v: int) -> dict[str, float]:
    """Bubble fraction of the step for equal stages and free communication (see module doc)."""
    interleaved = (p - 1) / (v * m + p - 1)
    if schedule in SINGLE_STAGE:
        return {"theory": (p - 1) / (m + p - 1)}
    if schedule == "interleaved_1f1b":
        return {"theory": interleaved}
    return {"theory": (p - 1) / (3 * v * m + p - 1), "theory_upper_bound": interleaved}


class BusyClock:
    """Seconds of stage compute on this rank, by kind, since the last reset. Timed regions never
    nest (forward, loss and backward calls follow each other), so one start time serves all."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(KINDS, 0.0)
        self._start = 0.0

    def reset(self) -> None:
        self.seconds = dict.fromkeys(KINDS, 0.0)

    def start(self) -> None:
        self._start = time.perf_counter()

    def stop(self, kind: str) -> None:
        self.seconds[kind] += time.perf_counter() - self._start

    def timed_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        self.start()
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        self.stop("loss")
        return loss

    def hook_forward(self, module: torch.nn.Module) -> list[RemovableHandle]:
        return [
            module.register_forward_pre_hook(lambda _m, _a: self.start()),
            module.register_forward_hook(lambda _m, _a, _o: self.stop("forward")),
        ]

    @contextmanager
    def timing_backward(self) -> Iterator[None]:
        """Time every stage backward (full, input, weight) by wrapping torch's single entry."""
        original: Callable[..., Any] = getattr(PipelineStage, BACKWARD_METHOD)

        def timed(stage: PipelineStage, backward_type: str, *rest: Any, **kw: Any) -> Any:
            self.start()
            try:
                return original(stage, backward_type, *rest, **kw)
            finally:
                self.stop(f"backward_{backward_type}")

        setattr(PipelineStage, BACKWARD_METHOD, timed)
        try:
            yield
        finally:
            setattr(PipelineStage, BACKWARD_METHOD, original)


def timed_step(
    runner: PipelineRunner, batch: tuple[torch.Tensor, torch.Tensor], clock: BusyClock
) -> tuple[float, dict[str, float]]:
    """One barrier-aligned training step: (slowest rank's wall seconds, this rank's busy)."""
    for module in runner.stage_modules:
        module.zero_grad(set_to_none=True)
    dist.barrier()
    clock.reset()
    start = time.perf_counter()
    runner.train_step(*batch)
    wall = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    busy = dict(clock.seconds)
    dist.all_reduce(wall, op=dist.ReduceOp.MAX)
    return wall.item(), busy


def measure(
    schedule: str, args: argparse.Namespace, pp_mesh: DeviceMesh, clock: BusyClock
) -> dict[str, Any]:
    """Warm up, time K steps of one schedule; every rank's busy time next to the step time."""
    p, m = pp_mesh.size(), args.microbatches
    v = stages_per_rank(schedule, args)
    num_stages = p * v
    margs = model_args(args)
    with torch.device("meta"):
        model = Decoder(margs)
    stage_ids = stage_ids_for_rank(pp_mesh.get_local_rank(), p, v, schedule)
    modules = [split_model(model, s, num_stages, spec=GPT_SPEC) for s in stage_ids]
    for module in modules:
        module.to_empty(device="cpu")
        init_weights(module, margs, SEED)
    handles = [h for module in modules for h in clock.hook_forward(module)]
    runner = PipelineRunner(
        modules, stage_ids, num_stages, pp_mesh, schedule, m, torch.device("cpu"), clock.timed_loss
    )
    gen = torch.Generator().manual_seed(SEED)  # the same batch on every rank
    rows = m * args.micro_batch_size
    batch = (
        torch.randint(margs.vocab_size, (rows, args.seq_len), generator=gen),
        torch.randint(margs.vocab_size, (rows, args.seq_len), generator=gen),
    )
    for _ in range(args.warmup):
        timed_step(runner, batch, clock)
    steps = [timed_step(runner, batch, clock) for _ in range(args.steps)]
    for handle in handles:
        handle.remove()
    walls = [wall for wall, _ in steps]
    mine = {
        "stage_ids": stage_ids,
        "busy_s": [sum(busy.values()) for _, busy in steps],
        "busy_by_kind_s": {k: sum(busy[k] for _, busy in steps) / len(steps) for k in KINDS},
    }
    per_rank: list[dict[str, Any]] = [{} for _ in range(p)]
    dist.all_gather_object(per_rank, mine)
    for rank_row in per_rank:
        rank_row["idle"] = 1 - sum(rank_row["busy_s"]) / sum(walls)
    return {
        "schedule": schedule,
        "p": p,
        "m": m,
        "v": v,
        **theory(schedule, p, m, v),
        "step_s": walls,
        "mean_step_s": sum(walls) / len(walls),
        "ranks": per_rank,
    }


def report(args: argparse.Namespace, results: list[dict[str, Any]]) -> None:
    """Print the table and write the JSON (rank 0 only)."""
    margs = model_args(args)
    print(
        f"\npipeline idle fraction per rank: p = {args.pp} ranks (gloo, CPU, 1 thread each), "
        f"m = {args.microbatches} microbatches of {args.micro_batch_size} x {args.seq_len} "
        f"tokens, GPT dim {margs.dim} x {margs.n_layers} layers, "
        f"{args.steps} timed steps after {args.warmup} warmup"
    )
    header = (
        f"{'schedule':<17} {'rank':>4} {'stages':>8} {'idle %':>7} {'theory %':>9} "
        f"{'step ms':>8} {'busy ms':>8}"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        for rank, row in enumerate(r["ranks"]):
            busy_ms = sum(row["busy_s"]) / len(row["busy_s"]) * 1e3
            print(
                f"{r['schedule']:<17} {rank:>4} {','.join(map(str, row['stage_ids'])):>8} "
                f"{row['idle'] * 100:>7.1f} {r['theory'] * 100:>9.1f} "
                f"{r['mean_step_s'] * 1e3:>8.1f} {busy_ms:>8.1f}"
            )
    for r in results:
        if "theory_upper_bound" in r:
            print(
                f"{r['schedule']}: theory is the ZB-H1-style estimate (p-1)/(3vm+p-1) for "
                f"T_F = T_B = T_W (Qi et al. 2023); upper bound (interleaved 1F1B) "
                f"{r['theory_upper_bound'] * 100:.1f}%"
            )
    print(
        "idle = 1 - busy / step (step: slowest rank, barrier-aligned); busy = stage forward, "
        "loss and backward compute. Communication and schedule overhead count as idle."
    )
    config = {
        "pp": args.pp,
        "microbatches": args.microbatches,
        "stages_per_rank_interleaved": args.stages_per_rank,
        "micro_batch_size": args.micro_batch_size,
        "seq_len": args.seq_len,
        "model": dataclasses.asdict(margs),
        "warmup": args.warmup,
        "steps": args.steps,
        "backend": "gloo",
        "threads_per_rank": 1,
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "idle": "1 - sum(busy) / sum(step), step = max over ranks of the barrier-aligned time",
    }
    write_json(args.out, {"config": config, "results": results})


def worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    ctx = init_distributed("cpu")
    try:
        pp_mesh = init_device_mesh("cpu", (ctx.world_size,), mesh_dim_names=("pp",))
        clock = BusyClock()
        with clock.timing_backward():
            results = [measure(s, args, pp_mesh, clock) for s in args.schedules]
        if ctx.rank == 0:
            report(args, results)
    finally:
        dist.destroy_process_group()


def main() -> None:
    argv = sys.argv[1:]
    args = parse_args(argv)
    unknown = set(args.schedules) - set(SCHEDULES)
    if unknown:
        raise SystemExit(f"unknown schedules {sorted(unknown)}; choose from {', '.join(SCHEDULES)}")
    if not hasattr(PipelineStage, BACKWARD_METHOD):
        raise SystemExit(f"this torch has no PipelineStage.{BACKWARD_METHOD} to time backward with")
    if is_worker():
        worker(args)
    else:
        launch_ranks(__file__, args.pp, argv)


if __name__ == "__main__":
    main()
