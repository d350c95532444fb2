"""distrain's default job against the same model trained the way a Hugging Face Accelerate user
would, side by side on this machine.

Both sides train distrain's GPT (the `tiny` preset unless --preset), from the same seeded weights,
on the same batches (distrain's loader: same global batch, same sample order), with AdamW (the same
hyper-parameters, decay groups, gradient clipping) and the same warmup + cosine schedule. distrain
runs its real `Trainer` (`train_step`, as `Trainer.run` calls it); the Accelerate side is a plain
torch loop over the module prepared by `accelerate.Accelerator` (DDP across the ranks,
`accelerator.accumulate` / `accelerator.backward`, its `mixed_precision` for bf16,
`accelerator.clip_grad_norm_`).

Variants (levers): fp32 vs bf16 autocast on both sides; torch's fused AdamW (`fused=True`) on the
Accelerate side (distrain's own AdamW is fused wherever torch has the kernel, optim.adamw_kernel);
processes x threads (2 x 1 and 1 x 2); and distrain with `training.compile` on (the whole model
and its loss as one graph), from a cold compile cache (an empty folder) and from a warm one (the
folder the cold run filled: a second run of the same job), each in processes of its own so
nothing compiled stays in memory between them. Every repetition runs every variant once, in the
same order, so the load of a shared machine falls on all of them alike; a variant's figure is its
median over --reps.

    tokens/s         global batch x seq_len x timed steps / time of the timed steps (slowest rank)
    setup s          building the trainer (model, wrappers, data) and the --warmup steps: where
                     a compile happens (at the first forward)
    time to target   setup s + seconds from the first timed step until the training loss (mean
                     over ranks) first reaches the target: the highest final loss of all
                     variants, so every variant reaches it
    ratio            tokens/s / tokens/s of "accelerate fp32 2x1"; time ratio: its time to
                     target / this variant's
    job s            the --job-steps job (default: the default job's 600 steps) projected at
                     this variant's pace: setup s + job steps x measured seconds per step; its
                     ratio is the baseline's / this variant's

Run from the repository root (it launches its own ranks through torchrun's API):

    python3 benchmarks/vs_accelerate.py --steps 8 --reps 2
    python3 benchmarks/vs_accelerate.py --only "distrain fp32 2x1,accelerate fp32 2x1"

It prints a table and writes JSON to --out (default benchmarks/results/vs_accelerate.json).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from harness import is_worker, launch_ranks, trainer_for, worker_session, write_json
from torch import nn

from distrain.config.schema import Config
from distrain.data import DistributedBatchLoader, build_datasets
from distrain.models.decoder.model import Decoder, init_weights, next_token_loss
from distrain.models.gpt.spec import GPT_SPEC
from distrain.models.registry import model_args
from distrain.optim.param_groups import param_groups
from distrain.optim.schedule import lr_at, set_lr
from distrain.parallel.device import DistContext, cpu_has_native_bf16

CORPUS_BYTES = 4_000_000
BASELINE = "accelerate fp32 2x1"
# (name, side, precision, fused AdamW, processes, threads per process, compile cache): the
# cache is "" for eager (distrain's default training.compile = auto is eager on CPU), else
# "cold" or "warm" for training.compile = true.
VARIANTS = (
    ("distrain fp32 2x1", "distrain", "fp32", False, 2, 1, ""),
    ("accelerate fp32 2x1", "accelerate", "fp32", False, 2, 1, ""),
    ("distrain bf16 2x1", "distrain", "bf16", False, 2, 1, ""),
    ("accelerate bf16 2x1", "accelerate", "bf16", False, 2, 1, ""),
    ("accelerate fp32 fused-adamw 2x1", "accelerate", "fp32", True, 2, 1, ""),
    ("distrain fp32 1x2", "distrain", "fp32", False, 1, 2, ""),
    ("accelerate fp32 1x2", "accelerate", "fp32", False, 1, 2, ""),
    ("distrain fp32 compile-cold 2x1", "distrain", "fp32", False, 2, 1, "cold"),
    ("distrain fp32 compile-warm 2x1", "distrain", "fp32", False, 2, 1, "warm"),
)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--reps", type=int, default=2, help="interleaved repetitions")
    parser.add_argument(
        "--job-steps",
        type=int,
        default=Config().training.steps,
        help="steps of the job whose wall time the table projects (default: the default job's)",
    )
    parser.add_argument("--out", default="benchmarks/results/vs_accelerate.json")
    parser.add_argument(
        "--only",
        help=f"comma-separated variant names (default: all, bf16 only on a CPU with native bf16 "
        f"matmuls; {BASELINE!r} always runs)",
    )
    # Set by the launcher for its workers.
    parser.add_argument("--ranks", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--variants", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def make_config(
    args: argparse.Namespace, precision: str, run_dir: Path, *, compile_: bool = False
) -> Config:
    """The default job (its batch, sequence length, optimizer and schedule) at this length."""
    cfg = Config()
    cfg.run.dir = str(run_dir)
    cfg.model.preset = args.preset
    cfg.data.max_bytes = CORPUS_BYTES
    cfg.training.precision = precision
    cfg.training.compile = "auto" if not compile_ else True
    cfg.training.steps = args.warmup + args.steps
    cfg.metrics.progress_bar = False
    cfg.metrics.tensorboard = False
    cfg.checkpoint.at_end = False
    cfg.checkpoint.interval_steps = 0
    cfg.validate()
    return cfg


def timed(
    step: Any, args: argparse.Namespace, device: torch.device, built: float
) -> dict[str, Any]:
    """Run `step(i) -> loss tensor` for warmup + timed steps; per-step elapsed seconds (the
    slowest rank's clock) and losses (mean over ranks), read after the loop: no host sync
    inside it beyond what the step itself does. `built`: perf_counter() before the build."""
    for i in range(args.warmup):
        step(i)
    dist.barrier()
    setup = time.perf_counter() - built
    start = time.perf_counter()
    ends, losses = [], []
    for i in range(args.warmup, args.warmup + args.steps):
        losses.append(step(i).detach().float())
        ends.append(time.perf_counter() - start)
    stats = torch.stack([torch.tensor(ends, dtype=torch.float64), torch.stack(losses).double()])
    dist.all_reduce(stats[:1], op=dist.ReduceOp.MAX)
    dist.all_reduce(stats[1:], op=dist.ReduceOp.SUM)
    setup_t = torch.tensor([setup], dtype=torch.float64)
    dist.all_reduce(setup_t, op=dist.ReduceOp.MAX)
    return {
        "setup_s": setup_t.item(),
        "ends": stats[0].tolist(),
        "losses": (stats[1] / dist.get_world_size()).tolist(),
    }


def run_distrain(cfg: Config, args: argparse.Namespace, ctx: DistContext, logger: Any) -> dict:
    built = time.perf_counter()
    trainer = trainer_for(cfg, ctx, logger)

    def step(i: int) -> torch.Tensor:
        loss, _, _ = trainer.train_step(trainer.loader.next_batch())
        trainer.step += 1
        return loss

    try:
        return timed(step, args, ctx.device, built)
    finally:
        trainer.close()


def build_accelerate(
    cfg: Config,
    ctx: DistContext,
    *,
    fused: bool,
    ddp_kwargs: dict[str, Any] | None = None,
) -> tuple[Callable[[int], torch.Tensor], nn.Module]:
    """The plain Accelerate DDP loop of `cfg`: (step(i) -> mean loss of step i, the prepared
    model). Its model starts from distrain's seeded weights, its loader is distrain's.
    `ddp_kwargs` are fields of Accelerate's `DistributedDataParallelKwargs`, e.g. its own
    communication hook: {"comm_hook": "power_sgd", "comm_state_option": {...}} (`comm_hook` a
    `DDPCommunicationHookType` value)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import DDPCommunicationHookType, DistributedDataParallelKwargs

    # One Accelerator per variant in this process: its state is a singleton, reset between
    # variants (the process group, PartialState's, stays).
    AcceleratorState._reset_state()
    kwargs = dict(ddp_kwargs or {})
    kwargs["comm_hook"] = DDPCommunicationHookType(kwargs.get("comm_hook", "no"))
    t, o = cfg.training, cfg.optim
    accum = t.global_batch_size // (t.micro_batch_size * ctx.world_size)
    accelerator = Accelerator(
        mixed_precision="bf16" if t.precision == "bf16" else "no",
        gradient_accumulation_steps=accum,
        cpu=ctx.device.type == "cpu",
        kwargs_handlers=[DistributedDataParallelKwargs(**kwargs)],
    )
    margs = model_args(cfg.model)
    torch.manual_seed(t.seed)
    model = Decoder(margs)
    init_weights(model, margs, t.seed)
    optimizer = torch.optim.AdamW(
        param_groups(model, o.weight_decay, GPT_SPEC.param_roles(model)),
        lr=o.lr,
        betas=(o.beta1, o.beta2),
        eps=o.eps,
        **({"fused": True} if fused else {"foreach": True}),
    )
    model, optimizer = accelerator.prepare(model, optimizer)
    train_set, _ = build_datasets(cfg.data, t.seq_len, vocab_size=margs.vocab_size)
    loader = DistributedBatchLoader(
        train_set,
        global_batch_size=t.global_batch_size,
        micro_batch_size=t.micro_batch_size,
        dp_rank=ctx.rank,
        dp_size=ctx.world_size,
        seed=t.seed,
    )

    def step(i: int) -> torch.Tensor:
        set_lr(optimizer, lr_at(i, cfg=o, total_steps=t.steps))
        total = torch.zeros((), device=accelerator.device)
        for inputs, targets in loader.next_batch():
            with accelerator.accumulate(model):
                inputs, targets = inputs.to(accelerator.device), targets.to(accelerator.device)
                loss = next_token_loss(model(inputs), targets)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), o.max_grad_norm)
                optimizer.step()
                optimizer.zero_grad()
                total += loss.detach()
        return total / accum

    return step, model


def run_accelerate(cfg: Config, args: argparse.Namespace, ctx: DistContext, fused: bool) -> dict:
    built = time.perf_counter()
    step, _ = build_accelerate(cfg, ctx, fused=fused)
    return timed(step, args, ctx.device, built)


def worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    run_dir = Path(args.run_dir)
    rows = []
    with worker_session(run_dir, "cpu") as (ctx, logger):
        for name in args.variants.split(","):
            _, side, precision, fused, _, _, cache = next(v for v in VARIANTS if v[0] == name)
            cfg = make_config(
                args, precision, run_dir / name.replace(" ", "_"), compile_=bool(cache)
            )
            Path(cfg.run.dir).mkdir(parents=True, exist_ok=True)
            if side == "distrain":
                result = run_distrain(cfg, args, ctx, logger)
            else:
                result = run_accelerate(cfg, args, ctx, fused)
            rows.append({"variant": name, **result})
        if ctx.rank == 0:
            Path(args.result).write_text(json.dumps(rows))


def selected(only: str | None) -> list[tuple]:
    """The variants --only names (and the baseline), in VARIANTS order. By default all of
    them, less the bf16 ones on a CPU without native bf16 matmuls: there autocast emulates
    bf16 several times slower than fp32 (training.precision = "auto" picks fp32) and those two
    rows would take most of the run."""
    if only is None:
        native = cpu_has_native_bf16()
        return [v for v in VARIANTS if native or v[2] != "bf16"]
    names = {n.strip() for n in only.split(",")} | {BASELINE}
    unknown = names - {v[0] for v in VARIANTS}
    if unknown:
        sys.exit(f"--only: unknown variant(s) {sorted(unknown)}; known: {[v[0] for v in VARIANTS]}")
    return [v for v in VARIANTS if v[0] in names]


def summarize(args: argparse.Namespace, runs: list[dict[str, Any]], tokens_per_step: int) -> list:
    """Median tokens/s and time to the target loss per variant, over the repetitions."""
    by_name: dict[str, list[dict]] = {}
    for r in runs:
        by_name.setdefault(r["variant"], []).append(r)
    target = max(r["losses"][-1] for r in runs)
    rows = []
    for name, reps in by_name.items():
        tps = [tokens_per_step * args.steps / r["ends"][-1] for r in reps]
        to_target = [
            r["setup_s"]
            + next(end for end, loss in zip(r["ends"], r["losses"], strict=True) if loss <= target)
            for r in reps
        ]
        rows.append(
            {
                "variant": name,
                "tokens_per_s": statistics.median(tps),
                "tokens_per_s_reps": tps,
                "setup_s": statistics.median(r["setup_s"] for r in reps),
                # The whole job at this variant's pace: its setup (compile included) once, then
                # every step at the measured steady rate.
                "projected_job_s": statistics.median(
                    r["setup_s"] + args.job_steps * r["ends"][-1] / args.steps for r in reps
                ),
                "time_to_target_s": statistics.median(to_target),
                "final_loss": statistics.median(r["losses"][-1] for r in reps),
                "losses": [r["losses"] for r in reps],
            }
        )
    base = next(r for r in rows if r["variant"] == BASELINE)
    for r in rows:
        r["ratio_tokens_per_s"] = r["tokens_per_s"] / base["tokens_per_s"]
        r["ratio_time_to_target"] = base["time_to_target_s"] / r["time_to_target_s"]
        r["ratio_projected_job"] = base["projected_job_s"] / r["projected_job_s"]
    return [target, rows]


def main() -> None:
    argv = sys.argv[1:]
    args = parse_args(argv)
    if is_worker():
        worker(args)
        return
    cfg = make_config(args, "fp32", Path("."))
    tokens_per_step = cfg.training.global_batch_size * cfg.training.seq_len
    variants = selected(args.only)
    # One launch per (processes, threads, compile cache): a compiled variant's processes start
    # with nothing compiled in memory, as a new run would.
    launches = sorted({(v[4], v[5], v[6]) for v in variants}, key=lambda k: (-k[0], k[2]))
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="distrain-vs-accelerate-") as tmp:
        for rep in range(args.reps):
            # Empty for the cold variant's launch, then filled: the warm one's is the same.
            cache = Path(tmp) / f"compile-cache-{rep}"
            for nproc, threads, kind in launches:
                names = [v[0] for v in variants if (v[4], v[5], v[6]) == (nproc, threads, kind)]
                result = Path(tmp) / f"rep{rep}-{nproc}x{threads}{kind}.json"
                extra = ["--ranks", str(nproc), "--threads", str(threads)]
                extra += ["--variants", ",".join(names), "--result", str(result)]
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache)
                launch_ranks(__file__, nproc, argv + extra, run_dir=f"{tmp}/run{rep}-{nproc}")
                runs.extend(json.loads(result.read_text()))
    target, rows = summarize(args, runs, tokens_per_step)
    t = cfg.training
    print(
        f"\npreset {args.preset}, global batch {t.global_batch_size} x seq {t.seq_len}, "
        f"micro-batch {t.micro_batch_size}, {args.warmup} warmup + {args.steps} timed steps, "
        f"{args.reps} interleaved reps (medians); target loss {target:.4f}; "
        f"torch {torch.__version__}"
    )
    header = (
        f"{'variant':<32} {'tokens/s':>9} {'setup s':>7} {'to target s':>11} {'final loss':>10} "
        f"{'ratio tok/s':>11} {'ratio time':>10} {'job s':>7} {'ratio job':>9}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['variant']:<32} {r['tokens_per_s']:>9,.0f} {r['setup_s']:>7.2f} "
            f"{r['time_to_target_s']:>11.2f} "
            f"{r['final_loss']:>10.4f} {r['ratio_tokens_per_s']:>11.2f} "
            f"{r['ratio_time_to_target']:>10.2f} {r['projected_job_s']:>7.0f} "
            f"{r['ratio_projected_job']:>9.2f}"
        )
    config = {
        "preset": args.preset,
        "global_batch_size": t.global_batch_size,
        "micro_batch_size": t.micro_batch_size,
        "seq_len": t.seq_len,
        "warmup": args.warmup,
        "steps": args.steps,
        "reps": args.reps,
        "target_loss": target,
        "job_steps": args.job_steps,
        "variants": [v[0] for v in selected(args.only)],
        "torch": torch.__version__,
    }
    write_json(args.out, {"config": config, "rows": rows})


if __name__ == "__main__":
    main()
