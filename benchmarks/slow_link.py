"""Time to loss over shaped links: a plain Hugging Face Accelerate DDP loop against distrain's
communication methods and its recipe for the link, side by side on the 2-host network lab.

Every run trains distrain's GPT (`--presets`, default small and tiny) from the same seeded
weights on the same batches (distrain's loader: the same global batch and sample order), with
AdamW and the same warmup + cosine schedule, for the same --steps, on two "hosts": the lab's two
network namespaces (tests/netlab.py) joined by a veth pair shaped by tc tbf to the link's rate,
one torchrun agent per host (--procs per host, OMP_NUM_THREADS=1 each; rendezvous on host 0's lab
address; gloo over lab0), or, for the "loopback" link, one standalone torchrun agent with every
rank on this machine's loopback. Variants:

    accelerate ddp     vs_accelerate.py's Accelerate loop (its best setting on this CPU: fp32,
                       foreach AdamW; bf16 autocast only pays on a CPU with native bf16)
    accelerate fp16/powersgd
                       the same loop with Accelerate's own DDP communication hook
                       (DistributedDataParallelKwargs.comm_hook; PowerSGD at rank 2 from step
                       2, as distrain's, in one gradient bucket: see ACCELERATE_HOOKS). Its
                       bf16 hook is torch's bf16_compress_hook, which refuses CPU tensors.
    distrain ddp       distrain's default (DDP, fp32 gradients, bucketed and overlapped)
    distrain fp16/bf16/powersgd/onebit
                       comm.gradient_compression (PowerSGD from step 2)
    distrain onebit_adam
                       optim.name onebit_adam (fp32 warm-up of 2 steps)
    distrain diloco hH bf16
                       DiLoCo with H inner steps (sites = the hosts, FSDP2 inside each,
                       pseudo-gradients averaged in bf16; outer lr 0.7, Nesterov momentum 0.5)

The recipe is the variant RECIPES names for the link (`recipe` column).

Every --eval-every steps (a multiple of every DiLoCo H, so DiLoCo is evaluated on its global
weights) the clock stops, the validation loss of a fixed set (training.eval_batches batches,
distrain's val_batches on both sides) is measured, and the clock restarts.

    time to loss   setup (process start to the model, optimizer and data built) + training time
                   until the first evaluation at or below the target: the peer's (accelerate
                   ddp's) final validation loss on the same link and preset, median over reps;
                   "-" when a run never reached it
    x best acc.    the fastest Accelerate variant's time to loss on the link / this one's
    tokens/s       global batch x seq_len x steps / training time (evaluations excluded)
    MB/step wire   bytes host 0 sent on lab0 during the run (/sys/class/net/lab0/statistics/
                   tx_bytes inside its namespace: setup, evaluations and TCP overhead included)
                   / steps; on loopback not measured
    MB/step count  what the framework counted (distrain: CommStats' and DiLoCo's wire bytes per
                   rank; the Accelerate loop counts nothing)
    scaling        tokens/s on the link / the same variant's tokens/s on loopback
    exposed s      s/step on the link minus s/step on loopback: communication not hidden behind
                   compute (and waiting for it)

Runs interleave: each repetition runs every (link, preset, variant) once, in that order; a
figure is the median over --reps, with the range [min-max] beside it. The 1-minute load average
is printed at the start and end (a shared machine's contention slows compute, which hides
communication: state it with the figures).

Run as root from the repository root (the lab needs network namespaces and tc):

    python3 benchmarks/slow_link.py --reps 2
    python3 benchmarks/slow_link.py --links loopback --presets tiny --steps 2 --eval-every 1 \\
        --variants "accelerate ddp,distrain ddp" --reps 1

It prints a table and writes JSON to --out (default benchmarks/results/slow_link.json).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "benchmarks"))

from harness import is_worker, trainer_for, wait_all, worker_session, write_json  # noqa: E402
from netlab import IFNAME, NetLab, lab_available, net_lab, parse_rate  # noqa: E402
from vs_accelerate import build_accelerate  # noqa: E402

from distrain.config.schema import Config  # noqa: E402
from distrain.data import build_datasets  # noqa: E402
from distrain.data.loader import val_batches  # noqa: E402
from distrain.family.spec import FamilyModel  # noqa: E402
from distrain.models.decoder.counts import num_params  # noqa: E402
from distrain.models.decoder.model import next_token_loss  # noqa: E402
from distrain.models.registry import model_args, model_family  # noqa: E402
from distrain.parallel.device import DistContext  # noqa: E402
from distrain.plan.collectives import (  # noqa: E402
    CONCURRENCY_BYTES,
    time_collective,
    time_concurrency,
)
from distrain.plan.comm_advice import predict_methods, recommend  # noqa: E402
from distrain.train.observers import CommMetrics  # noqa: E402

LOOPBACK = "loopback"
PEER = "accelerate ddp"
LINK_PROBE = "link probe"
"""Not a variant: before a link's runs (loopback's too), the ranks time one all-reduce of the
preset's fp32 gradients (plain DDP's bytes per step, as one message) over it, and measure how far
an all-reduce progresses while they compute (`probe_link`)."""
PROBE_REPEATS = 5
FREEZE_STEP = 2  # onebit_adam's fp32 warm-up, and PowerSGD's start
PORT = 29300  # rendezvous port; each run adds its own offset
RUN_TIMEOUT_S = 1800
CORPUS_BYTES = 4_000_000


def _diloco(inner_steps: int) -> dict[str, Any]:
    # Outer momentum 0.5, not the default 0.9: over a budget of a few outer steps 0.9's
    # Nesterov step overshoots (32 steps of `small` at H = 4: val loss 10% above DDP's).
    return {
        "diloco__inner_steps": inner_steps,
        "diloco__outer_lr": 0.7,
        "diloco__outer_momentum": 0.5,
        "diloco__sync_dtype": "bf16",
        "parallel__zero_stage": 2,
        "parallel__dp_replicate": 2,  # the two hosts are the sites
    }


# The Accelerate loop's variants: name -> its DistributedDataParallelKwargs fields. torch's
# PowerSGD hook issues its second all-reduce from the first one's completion callback; gloo runs
# those on its own threads in whatever order buckets finish, so with several buckets two ranks
# can issue them in different orders and gloo aborts ("Received data size doesn't match"). One
# bucket (all of `small`'s 43 MB) keeps one chain per step: what distrain's own PowerSGD does on
# gloo by finishing each bucket's chain before the next (distrain.parallel.compress).
ACCELERATE_HOOKS: dict[str, dict[str, Any]] = {
    PEER: {},
    "accelerate fp16": {"comm_hook": "fp16"},
    "accelerate powersgd": {
        "comm_hook": "power_sgd",
        "comm_state_option": {"matrix_approximation_rank": 2, "start_powerSGD_iter": FREEZE_STEP},
        "bucket_cap_mb": 1024,
    },
}
# name -> config fields (section__field) of the distrain variants; the Accelerate loop's have none.
VARIANTS: dict[str, dict[str, Any]] = {
    **{name: {} for name in ACCELERATE_HOOKS},
    "distrain ddp": {},
    "distrain fp16": {"comm__gradient_compression": "fp16"},
    "distrain bf16": {"comm__gradient_compression": "bf16"},
    "distrain powersgd": {
        "comm__gradient_compression": "powersgd",
        "comm__powersgd_start_step": FREEZE_STEP,
    },
    "distrain onebit": {"comm__gradient_compression": "onebit"},
    "distrain onebit_adam": {"optim__name": "onebit_adam"},
    "distrain diloco h4 bf16": _diloco(4),
    "distrain diloco h8 bf16": _diloco(8),
}
DEFAULT_VARIANTS = (
    PEER,
    "distrain ddp",
    "distrain bf16",
    "distrain powersgd",
    "distrain onebit_adam",
    "distrain diloco h4 bf16",
    "distrain diloco h8 bf16",
)
# The recipe per link: what distrain would run there. On a slow link the pseudo-gradients of H
# steps cost what one step's gradients cost DDP; H grows as the link slows.
RECIPES = {
    LOOPBACK: "distrain ddp",
    "1gbit": "distrain diloco h4 bf16",
    "100mbit": "distrain diloco h8 bf16",
}


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    split = lambda s: [x.strip() for x in s.split(",") if x.strip()]  # noqa: E731
    parser.add_argument("--links", type=split, default=["100mbit", "1gbit", LOOPBACK])
    parser.add_argument("--presets", type=split, default=["small", "tiny"])
    parser.add_argument("--variants", type=split, default=list(DEFAULT_VARIANTS))
    parser.add_argument("--steps", type=int, default=24, help="optimizer steps per run")
    parser.add_argument("--eval-every", type=int, default=8, help="steps between evaluations")
    parser.add_argument("--reps", type=int, default=2, help="interleaved repetitions")
    parser.add_argument("--procs", type=int, default=1, help="processes per host")
    parser.add_argument("--global-batch-size", type=int, default=8)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--eval-batches", type=int, default=4)
    parser.add_argument("--out", default="benchmarks/results/slow_link.json")
    # Set by the launcher for its workers.
    parser.add_argument("--preset", help=argparse.SUPPRESS)
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    unknown = sorted(set(args.variants) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    if PEER not in args.variants:
        parser.error(f"--variants must include {PEER!r}: it sets the target loss")
    for name in args.variants:
        h = VARIANTS[name].get("diloco__inner_steps", 1)
        if args.eval_every % h:
            parser.error(f"--eval-every must be a multiple of {name}'s H = {h}")
    if args.steps % args.eval_every:
        parser.error("--steps must be a multiple of --eval-every (the last step is evaluated)")
    return args


def make_config(args: argparse.Namespace, run_dir: Path, variant: str) -> Config:
    cfg = Config()
    cfg.run.dir = str(run_dir)
    cfg.run.device = "cpu"
    cfg.model.preset = args.preset
    cfg.data.max_bytes = CORPUS_BYTES
    t = cfg.training
    t.precision = "fp32"
    t.steps = args.steps
    t.global_batch_size = args.global_batch_size
    t.micro_batch_size = args.micro_batch_size
    t.seq_len = args.seq_len
    t.eval_batches = args.eval_batches
    cfg.optim.warmup_steps = 4
    cfg.optim.onebit.freeze_step = FREEZE_STEP
    cfg.metrics.progress_bar = False
    cfg.metrics.tensorboard = False
    cfg.checkpoint.at_end = False
    cfg.checkpoint.interval_steps = 0
    for name, value in VARIANTS[variant].items():
        section, field = name.split("__")
        setattr(getattr(cfg, section), field, value)
    if cfg.diloco.inner_steps:
        cfg.parallel.dp_shard = int(os.environ["WORLD_SIZE"]) // cfg.parallel.dp_replicate
    cfg.validate()
    return cfg


def timed_run(
    step: Callable[[int], None],
    evaluate: Callable[[], torch.Tensor],
    args: argparse.Namespace,
    setup_s: float,
) -> dict[str, Any]:
    """`step(i)` for every step, the clock stopped around `evaluate()` every --eval-every
    steps; times are the slowest rank's (each segment ends at a barrier)."""
    train_s, points = 0.0, []
    dist.barrier()
    for i in range(args.steps):
        start = time.perf_counter()
        step(i)
        if (i + 1) % args.eval_every == 0:
            dist.barrier()
            train_s += time.perf_counter() - start
            points.append((setup_s + train_s, float(evaluate())))
        else:
            train_s += time.perf_counter() - start
    return {"setup_s": setup_s, "train_s": train_s, "evals": points}


def run_distrain(cfg: Config, args: argparse.Namespace, ctx: DistContext, logger: Any) -> dict:
    trainer = trainer_for(cfg, ctx, logger)
    setup = _setup_s()
    stats = next(o.stats for o in trainer.observers if isinstance(o, CommMetrics))
    stats.reset()

    def step(i: int) -> None:
        trainer.train_step(trainer.loader.next_batch(), report_loss=False)
        trainer.step += 1

    try:
        result = timed_run(step, lambda: torch.tensor(trainer.evaluate()), args, setup)
        counted = stats.snapshot()["bytes_sent"]
        if trainer.outer is not None:
            counted += trainer.outer.take_bytes()
        return {**result, "counted_bytes_per_step": counted / args.steps}
    finally:
        trainer.close()


def run_accelerate(cfg: Config, args: argparse.Namespace, ctx: DistContext) -> dict:
    step_fn, model = build_accelerate(
        cfg, ctx, fused=False, ddp_kwargs=ACCELERATE_HOOKS[args.variant]
    )
    t = cfg.training
    _, val_set = build_datasets(cfg.data, t.seq_len, vocab_size=model_args(cfg.model).vocab_size)
    batches = val_batches(
        val_set,
        num_batches=t.eval_batches,
        global_batch_size=t.global_batch_size,
        micro_batch_size=t.micro_batch_size,
        dp_rank=ctx.rank,
        dp_size=ctx.world_size,
    )

    @torch.no_grad()
    def evaluate() -> torch.Tensor:
        model.eval()
        loss = sum(next_token_loss(model(x), y) for x, y in batches) / len(batches)
        model.train()
        dist.all_reduce(loss)
        return loss / ctx.world_size

    result = timed_run(step_fn, evaluate, args, _setup_s())
    return {**result, "counted_bytes_per_step": None}


def probe_link(cfg: Config) -> dict[str, Any]:
    """The link's rate as gloo's all-reduce achieves it: the median seconds of one all-reduce of
    `cfg`'s fp32 gradients (distrain.plan.collectives.time_collective, after two untimed), and
    the bytes each rank sends for it (a ring: 2 (n - 1) / n of the message); and the ranks'
    concurrency over it (time_concurrency, as `distrain plan --calibrate` measures it)."""
    cpu = torch.device("cpu")
    nbytes = 4 * num_params(model_args(cfg.model))
    seconds = time_collective("all_reduce", nbytes, PROBE_REPEATS, cpu)
    n = dist.get_world_size()
    sent = 2 * (n - 1) / n * nbytes
    return {
        "allreduce_bytes": nbytes,
        "allreduce_s": seconds,
        "sent_bytes": sent,
        "sent_bytes_per_s": sent / seconds,
        "concurrency": time_concurrency(CONCURRENCY_BYTES, PROBE_REPEATS, cpu),
    }


def _setup_s() -> float:
    """Seconds since this worker's process started (the launcher's start time), the slowest
    rank's."""
    elapsed = torch.tensor([time.time() - float(os.environ["SLOW_LINK_START"])])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed)


def worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    run_dir = Path(args.run_dir)
    with worker_session(run_dir, "cpu") as (ctx, logger):
        if args.variant == LINK_PROBE:
            result = probe_link(make_config(args, run_dir, "distrain ddp"))
        elif args.variant in ACCELERATE_HOOKS:
            result = run_accelerate(make_config(args, run_dir, args.variant), args, ctx)
        else:
            result = run_distrain(make_config(args, run_dir, args.variant), args, ctx, logger)
        if ctx.rank == 0:
            Path(args.result).write_text(json.dumps(result))


# --- the launcher ------------------------------------------------------------------------------


def tx_bytes(lab: NetLab, host: int) -> int:
    out = subprocess.run(
        ["ip", "netns", "exec", lab.hosts[host].ns, "cat", f"/sys/class/net/{IFNAME}/statistics/"
         "tx_bytes"],
        capture_output=True, text=True, check=True, timeout=30,
    )  # fmt: skip
    return int(out.stdout)


def worker_argv(args: argparse.Namespace, preset: str, variant: str, result: Path) -> list[str]:
    passed = [
        *("--steps", str(args.steps), "--eval-every", str(args.eval_every)),
        *("--global-batch-size", str(args.global_batch_size)),
        *("--micro-batch-size", str(args.micro_batch_size), "--seq-len", str(args.seq_len)),
        *("--eval-batches", str(args.eval_batches)),
    ]
    return [
        str(Path(__file__).resolve()),
        *passed,
        *("--preset", preset, "--variant", variant),
        *("--variants", PEER if variant == LINK_PROBE else f"{PEER},{variant}"),
        *("--result", str(result)),
        *("--run-dir", str(result.with_suffix(""))),
    ]


def run_env() -> dict[str, str]:
    return {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "SLOW_LINK_START": str(time.time())}


def run_once(
    args: argparse.Namespace, link: str, lab: NetLab | None, preset: str, variant: str,
    work: Path, port: int,
) -> dict[str, Any]:  # fmt: skip
    tag = f"{link}-{preset}-{variant.replace(' ', '_')}-{port}"
    result, log = work / f"{tag}.json", work / f"{tag}.log"
    torchrun = [sys.executable, "-m", "torch.distributed.run"]
    argv = worker_argv(args, preset, variant, result)
    with log.open("w") as out:
        if lab is None:
            cmd = [*torchrun, "--standalone", f"--nproc-per-node={2 * args.procs}", *argv]
            procs = [
                subprocess.Popen(
                    cmd, env={**os.environ, **run_env()}, stdout=out, stderr=subprocess.STDOUT
                )
            ]
            wait_all(procs, log, timeout_s=RUN_TIMEOUT_S)
            wire = None
        else:
            before = tx_bytes(lab, 0)
            env = run_env()
            procs = [
                lab.run(
                    host,
                    [*torchrun, "--nnodes=2", f"--nproc-per-node={args.procs}"]
                    + [f"--node-rank={host}", "--rdzv-backend=c10d", f"--rdzv-id={tag}"]
                    + [f"--rdzv-endpoint={lab.hosts[0].addr}:{port}", *argv],
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )
                for host in (0, 1)
            ]
            wait_all(procs, log, timeout_s=RUN_TIMEOUT_S)
            wire = (tx_bytes(lab, 0) - before) / args.steps
    return {**json.loads(result.read_text()), "wire_bytes_per_step": wire}


def time_to(run: dict[str, Any], target: float) -> float | None:
    return next((t for t, loss in run["evals"] if loss <= target), None)


def summarize(
    args: argparse.Namespace,
    runs: dict[tuple[str, str, str], list[dict[str, Any]]],
    probes: dict[tuple[str, str], list[dict[str, Any]]],
) -> list[dict[str, Any]]:
    rows = []
    tokens = args.global_batch_size * args.seq_len * args.steps
    for (link, preset, variant), reps in runs.items():
        peer = runs[(link, preset, PEER)]
        target = statistics.median(r["evals"][-1][1] for r in peer)
        times = [time_to(r, target) for r in reps]
        rows.append(
            {
                "link": link,
                "preset": preset,
                "variant": variant,
                "recipe": RECIPES.get(link) == variant,
                "target_val_loss": target,
                "time_to_loss_s": times,
                "tokens_per_s": [tokens / r["train_s"] for r in reps],
                "step_s": [r["train_s"] / args.steps for r in reps],
                "setup_s": [r["setup_s"] for r in reps],
                "final_val_loss": [r["evals"][-1][1] for r in reps],
                "wire_bytes_per_step": [r["wire_bytes_per_step"] for r in reps],
                "counted_bytes_per_step": [r["counted_bytes_per_step"] for r in reps],
                "evals": [r["evals"] for r in reps],
                "planner_prediction": None,  # filled below, from the loopback run
            }
        )
    by_key = {(r["link"], r["preset"], r["variant"]): r for r in rows}
    for r in rows:
        base = by_key.get((LOOPBACK, r["preset"], r["variant"]))
        peer = by_key[(r["link"], r["preset"], PEER)]
        r["scaling_vs_loopback"] = _ratio(r["tokens_per_s"], base["tokens_per_s"]) if base else None
        r["exposed_s_per_step"] = _median(r["step_s"]) - _median(base["step_s"]) if base else None
        peer_time, own = _median(peer["time_to_loss_s"]), _median(r["time_to_loss_s"])
        r["time_to_loss_x_peer"] = peer_time / own if peer_time and own else None
        reached = [
            _median(a["time_to_loss_s"])
            for a in rows
            if (a["link"], a["preset"]) == (r["link"], r["preset"])
            and a["variant"] in ACCELERATE_HOOKS
            and _median(a["time_to_loss_s"])
        ]
        best = min(reached, default=None)
        r["time_to_loss_x_best_accelerate"] = best / own if best and own else None
        r["tokens_per_s_x_peer"] = _ratio(r["tokens_per_s"], peer["tokens_per_s"])
        r["val_loss_vs_peer"] = _median(r["final_val_loss"]) / r["target_val_loss"] - 1
        loopback = probes.get((LOOPBACK, r["preset"]))
        probed = probes.get((r["link"], r["preset"]))
        if r["link"] != LOOPBACK and base is not None and loopback and probed:
            r["link_probe"] = {
                **_probed(probed),
                "shaped_bits_per_s": parse_rate(r["link"]),
                "runs": probed,
            }
            r["planner_prediction"] = planner_prediction(
                args,
                r["link"],
                r["preset"],
                r["variant"],
                loopback_step_s=_median(base["step_s"]),
                loopback=_probed(loopback),
                probed=r["link_probe"],
            )
    return rows


def _probed(runs: list[dict[str, Any]]) -> dict[str, float]:
    """A link's probed rate and concurrency: the medians over its probes."""
    return {
        key: statistics.median(p[key] for p in runs) for key in ("sent_bytes_per_s", "concurrency")
    }


WARMED_UP = ("distrain powersgd", "distrain onebit_adam")
"""Variants whose first FREEZE_STEP steps run plain fp32 DDP."""
PLANNER_METHODS = {
    "distrain ddp": "plain",
    "distrain bf16": "bf16",
    "distrain powersgd": "powersgd",
    "distrain onebit": "onebit",
    "distrain onebit_adam": "onebit_adam",
}


def planner_prediction(
    args: argparse.Namespace,
    link: str,
    preset: str,
    variant: str,
    *,
    loopback_step_s: float,
    loopback: dict[str, float],
    probed: dict[str, float],
) -> dict[str, Any]:
    """What the planner's communication model (distrain.plan.comm_advice) predicts on this link
    for this variant (2 ranks, one per host, fp32): its step seconds and bytes per step over the
    run (the steady step, and plain DDP's for a variant's warm-up steps), and the method it
    recommends. The compute is the variant's own: the compute at which the model's step on
    loopback (its probed rate and concurrency) is the step measured there (`compute_s`). The
    step on the link's shaped rate takes this machine's concurrency as `distrain plan
    --calibrate` measures it (on loopback); `step_s_measured_link` is the step on the rate and
    concurrency the link probe measured on the link itself."""
    cfg = make_config(argparse.Namespace(**{**vars(args), "preset": preset}), Path("-"), PEER)
    model = FamilyModel(model_family(cfg.model.family), model_args(cfg.model))

    def methods(bandwidth: float, concurrency: float, compute_s: float) -> list:
        return predict_methods(
            model,
            compute_s=compute_s,
            replicas=2 * args.procs,
            bandwidth=bandwidth,
            sites=2,
            sync_dtype="bf16",
            max_inner_steps=args.steps,
            concurrency=concurrency,
        )

    def predicted(probe: dict[str, float], compute_s: float) -> dict[str, float] | None:
        found = methods(probe["sent_bytes_per_s"], probe["concurrency"], compute_s)
        return _predicted(args, variant, found, compute_s)

    shaped = {**loopback, "sent_bytes_per_s": parse_rate(link) / 8 / args.procs}
    own = predicted(loopback, loopback_step_s) is not None
    compute = (
        _compute(lambda c: predicted(loopback, c)["step_s"], loopback_step_s)
        if own
        else loopback_step_s
    )
    chosen = recommend(methods(shaped["sent_bytes_per_s"], shaped["concurrency"], compute))
    found: dict[str, Any] = {
        "recommended": chosen.recommended.method,
        "recommended_inner_steps": chosen.recommended.inner_steps,
    }
    if not own:
        return found
    return {
        **found,
        **predicted(shaped, compute),
        "step_s_measured_link": predicted(probed, compute)["step_s"],
        "compute_s": compute,
        "concurrency": shaped["concurrency"],
    }


def _compute(step_s: Callable[[float], float], measured_s: float) -> float:
    """The compute at which the predicted step `step_s(compute)` (increasing in it) is
    `measured_s`, by bisection; 0 when even no compute predicts a longer step."""
    low, high = 0.0, measured_s
    if step_s(low) >= measured_s:
        return 0.0
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if step_s(mid) < measured_s else (low, mid)
    return (low + high) / 2


def _predicted(
    args: argparse.Namespace, variant: str, found: list, compute_s: float
) -> dict[str, float] | None:
    """The step seconds and bytes per step of `variant` among the planner's methods `found`."""
    by_method = {m.method: m for m in found}
    if variant in PLANNER_METHODS and PLANNER_METHODS[variant] in by_method:
        m, plain = by_method[PLANNER_METHODS[variant]], by_method["plain"]
        # The planner predicts the steady step; the run's first FREEZE_STEP steps of PowerSGD
        # and 1-bit Adam are plain fp32 DDP.
        warm = FREEZE_STEP if variant in WARMED_UP else 0
        return {
            key: (warm * getattr(plain, key) + (args.steps - warm) * getattr(m, key)) / args.steps
            for key in ("step_s", "bytes_per_step")
        }
    if variant.startswith("distrain diloco h") and "diloco" in by_method:
        m = by_method["diloco"]  # its outer all-reduce, spread over this variant's H instead
        h = int(variant.split()[2][1:])
        outer_s, outer_bytes = m.comm_s * m.inner_steps, m.bytes_per_step * m.inner_steps
        return {"step_s": compute_s + outer_s / h, "bytes_per_step": outer_bytes / h}
    return None


def _median(values: list[float | None]) -> float | None:
    """The median, or None when any value is None (a run that never reached the target: the
    median of the others would flatter it)."""
    if not values or any(v is None for v in values):
        return None
    return statistics.median(values)  # type: ignore[type-var]


def _ratio(a: list[float], b: list[float]) -> float:
    return statistics.median(a) / statistics.median(b)


def _fmt(values: list[float | None], scale: float = 1.0, spec: str = ".1f") -> str:
    """Median and [min-max] over reps ("-" when a run has no value)."""
    if any(v is None for v in values):
        return "-"
    vals = [v * scale for v in values]  # type: ignore[operator]
    med = format(statistics.median(vals), spec)
    if len(vals) == 1:
        return med
    return f"{med} [{min(vals):{spec}}-{max(vals):{spec}}]"


def report(args: argparse.Namespace, rows: list[dict[str, Any]], load: tuple[float, float]) -> None:
    t = args
    print(
        f"\nslow links: 2 hosts x {args.procs} process(es) (gloo, CPU, OMP_NUM_THREADS=1), "
        f"global batch {t.global_batch_size} x seq {t.seq_len}, micro-batch "
        f"{t.micro_batch_size}, {t.steps} steps, val every {t.eval_every}, {t.reps} interleaved "
        f"reps: median [min-max]; torch {torch.__version__}"
    )
    print(f"1-minute load average at start / end: {load[0]:.2f} / {load[1]:.2f} ({os.cpu_count()} "
          "cores, shared)")  # fmt: skip
    header = (
        f"{'link':<9}{'preset':<7}{'variant':<25}{'to loss s':>20}{'x peer':>7}{'tokens/s':>20}"
        f"{'x peer':>7}{'MB/step wire':>20}{'MB/step cnt':>12}{'val loss':>22}{'scaling':>8}"
        f"{'exposed s':>10}{'plan s/step':>12}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        name = r["variant"] + (" *" if r["recipe"] else "")
        x_time = r["time_to_loss_x_peer"]
        scaling, exposed = r["scaling_vs_loopback"], r["exposed_s_per_step"]
        print(
            f"{r['link']:<9}{r['preset']:<7}{name:<25}{_fmt(r['time_to_loss_s']):>20}"
            f"{(f'{x_time:.2f}' if x_time else '-'):>7}{_fmt(r['tokens_per_s'], spec='.0f'):>20}"
            f"{r['tokens_per_s_x_peer']:>7.2f}"
            f"{_fmt(r['wire_bytes_per_step'], 1e-6, '.2f'):>20}"
            f"{_fmt(r['counted_bytes_per_step'], 1e-6, '.2f'):>12}"
            f"{_fmt(r['final_val_loss'], spec='.4f'):>22}"
            f"{(f'{scaling:.2f}' if scaling else '-'):>8}"
            f"{(f'{exposed:.3f}' if exposed is not None else '-'):>10}"
            f"{_planned(r):>12}"
        )
    print("* the recipe for the link; x peer: accelerate ddp's time to loss / this one's, and "
          "tokens/s / accelerate ddp's")  # fmt: skip


def _planned(row: dict[str, Any]) -> str:
    """The planner's predicted s/step beside the measured one ("-" without a prediction)."""
    plan = row["planner_prediction"] or {}
    if "step_s" not in plan:
        return "-"
    return f"{plan['step_s']:.3f}"


def main() -> None:
    args = parse_args(sys.argv[1:])
    if is_worker():
        worker(args)
        return
    shaped = [link for link in args.links if link != LOOPBACK]
    reason = lab_available() if shaped else None
    if reason is not None:
        sys.exit(f"the network lab is unavailable: {reason}")
    work = Path(tempfile.mkdtemp(prefix="distrain-slow-link-"))
    load_start = os.getloadavg()[0]
    runs: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    probes: dict[tuple[str, str], list[dict[str, Any]]] = {}
    port = PORT
    for rep in range(args.reps):
        for link in args.links:
            for preset in args.presets:
                lab_cm = net_lab(2, rate=link) if link != LOOPBACK else contextlib.nullcontext()
                with lab_cm as lab:
                    port += 1
                    probe = run_once(args, link, lab, preset, LINK_PROBE, work, port)
                    probes.setdefault((link, preset), []).append(probe)
                    rate = probe["sent_bytes_per_s"] * 8e-6
                    print(
                        f"rep {rep} {link} {preset} link probe: {rate:.0f} Mbit/s, "
                        f"concurrency {probe['concurrency']:.2f}"
                    )
                    for variant in args.variants:
                        port += 1
                        run = run_once(args, link, lab, preset, variant, work, port)
                        runs.setdefault((link, preset, variant), []).append(run)
                        # What ran so far, should a later run fail or be stopped.
                        partial = [{"key": k, "runs": v} for k, v in runs.items()]
                        Path(args.out).with_suffix(".partial.json").write_text(json.dumps(partial))
                        print(
                            f"rep {rep} {link} {preset} {variant}: {run['train_s']:.1f} s, "
                            f"val {run['evals'][-1][1]:.4f}, load {os.getloadavg()[0]:.2f}",
                            flush=True,
                        )
    rows = summarize(args, runs, probes)
    load = (load_start, os.getloadavg()[0])
    report(args, rows, load)
    config = {
        key: getattr(args, key)
        for key in ("links", "presets", "variants", "steps", "eval_every", "reps", "procs")
    }
    config |= {
        "global_batch_size": args.global_batch_size,
        "micro_batch_size": args.micro_batch_size,
        "seq_len": args.seq_len,
        "eval_batches": args.eval_batches,
        "recipes": RECIPES,
        "torch": torch.__version__,
        "load_average_start_end": load,
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
    }
    write_json(args.out, {"config": config, "rows": rows})
    Path(args.out).with_suffix(".partial.json").unlink()
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
