"""Recovery time after a rank's death: the restart path (an elastic run resumes from its checkpoint)
beside the in-process path (replica groups: the survivors redo the step without the dead group).

Each run is a real `distrain train --nproc 2 --max-restarts 1` (CPU, gloo, `tiny` preset) in which
rank 1 SIGKILLs itself as step K begins (`debug.fail_mode = kill`), right after the checkpoint of
step K-1. torchrun's agent notices the dead worker, stops the survivor, rendezvouses again and
starts a new worker group, whose ranks resume from step K-1 and complete step K.

The milestones come from clocks on this machine, without changes to the trainer:
- kill: the timestamp of rank 1's "crashes at step K (kill)" log line, written just before SIGKILL;
- detected: arrival of the agent's "Worker group FAILED" line on its stderr (LOGLEVEL=INFO);
- rendezvous: arrival of the agent's next "Rendezvous complete" line (survivor stopped, new round);
- workers up: rank 0's next "rank 0/2 on" log line (spawn, `import torch`, process group);
- resumed: rank 0's next "resumed from" log line (data, model build, checkpoint load);
- first step: arrival of step K's row in metrics.jsonl, which this script polls every 5 ms.
Log timestamps have 1 ms resolution; arrival times are stamped here as lines appear.

The in-process path runs the same 2 ranks as 2 replica groups of 1 rank each
(`fault_tolerance.replica_groups = 2`, ZeRO-3, one `distrain train --nproc 1 --max-restarts 1`
per group with one CPU thread each, around `distrain lighthouse` with its default timeouts, or
those of --heartbeat-ms). Once group 0 has logged step --inprocess-kill-step - 1 this script
SIGKILLs group 1's worker; it measures the seconds from the kill to the arrival of group 0's
next completed step, the steps recomputed (training rows group 0 logged twice: none), group
0's own `recovery_s` metrics row, and group 1's rejoin: the live state's size and the seconds
its transfer took (its `rejoined` row). The phases come from torchft's own logs (RUST_LOG=info,
ms timestamps, in group 0's rank log), without changes to the trainer:
- kill->error: to group 0's vote not to commit (its average between groups failed);
- error->quorum: to group 0's new quorum without group 1 (the lighthouse forms it once it
  finds group 1 gone: kill->found gone is its log line saying so, when group 1's manager
  server refused its connection);
- quorum->redone vote: the process group reconfigured and the step redone by group 0 alone;
- vote->step row: the optimizer step and the metrics row.
A steady step before the kill is split the same way: the quorum, the step up to the vote
(forward, backward, the average between groups) and what follows the vote. Its median is
compared with the restart path's steady step: that run is the same 2 ranks (ZeRO-3, one thread
each) as one group, the plain run without replica groups.
The paths alternate run by run.

The live state travels sealed (ChaCha20-Poly1305 under a key of each request,
distrain/ft/transport.py): `state_protection` in the JSON is what that costs on this machine,
MB/s of sealing and opening a state of the rejoin's size beside `torch.save` of it (best of 5).

Run from the repository root:

    python3 benchmarks/recovery.py                 # 3 runs, kill at step 5
    python3 benchmarks/recovery.py --runs 5 --kill-step 9
    python3 benchmarks/recovery.py --paths restart      # or: inprocess
    python3 benchmarks/recovery.py --paths inprocess --heartbeat-ms 300,1000
    python3 benchmarks/recovery.py --protection-only --out benchmarks/results/state_protection.json

It prints a table (per run and the median) and writes JSON to --out
(default benchmarks/results/recovery.json).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import torch
from harness import write_json

from distrain.ft.lighthouse import DEFAULT_HEARTBEAT_TIMEOUT_MS, DEFAULT_JOIN_TIMEOUT_S

NUM_RANKS = 2
LOG_TIME_FORMAT = "%Y-%m-%d %H:%M:%S,%f"
POLL_S = 0.005
INPROCESS_STEPS_AFTER_KILL = 80
# What every path's run shares (the tiny preset; ZeRO-3: one replica group's layout, so the plain
# run is what the replica groups' steady step compares with): each adds its run dir and steps.
PLAIN_FIELDS = {
    "data.max_bytes": "4000000",
    "training.global_batch_size": "8",
    "training.micro_batch_size": "2",
    "training.seq_len": "64",
    "training.log_interval_steps": "1",
    "training.eval_interval_steps": "0",
    "parallel.zero_stage": "3",
    "checkpoint.interval_steps": "0",
    "checkpoint.at_end": "false",
    "metrics.progress_bar": "false",
    "metrics.tensorboard": "false",
}
TORCHFT_TIME_FORMAT = "%Y-%m-%dT%H:%M:%S.%f"
LIGHTHOUSE_TIME_FORMAT = "%Y-%m-%d %H:%M:%S,%f"
"""`distrain lighthouse`'s log lines (Python logging's asctime, ms)."""
# (phase, milestone that ends it); each phase starts where the previous one ended, at "kill" first.
PHASES = [
    ("detect death", "detected"),
    ("stop + rendezvous", "rendezvous"),
    ("worker start", "workers_up"),
    ("build + resume load", "resumed"),
    ("first step", "first_step"),
]


def log_times(path: Path, needle: str) -> list[float]:
    """Wall-clock times of the lines of a distrain rank log that contain `needle`."""
    times = []
    for line in path.read_text().splitlines():
        if needle in line:
            stamp = " ".join(line.split(" ", 2)[:2])
            times.append(datetime.strptime(stamp, LOG_TIME_FORMAT).timestamp())
    return times


def first_after(times: list[float], start: float, what: str) -> float:
    later = [t for t in times if t >= start]
    if not later:
        raise RuntimeError(f"no {what} after the kill; did the log format change?")
    return later[0]


class MetricsPoller(threading.Thread):
    """Stamps each metrics.jsonl row with the wall-clock time it was first seen."""

    def __init__(self, path: Path) -> None:
        super().__init__(daemon=True)
        self.path = path
        self.rows: list[tuple[float, dict[str, Any]]] = []
        self.done = threading.Event()

    def run(self) -> None:
        offset, partial = 0, ""
        while not self.done.is_set():
            if self.path.exists():
                with open(self.path) as f:
                    f.seek(offset)
                    chunk = f.read()
                    offset = f.tell()
                now = time.time()
                *lines, partial = (partial + chunk).split("\n")
                self.rows += [(now, json.loads(line)) for line in lines if line.strip()]
            time.sleep(POLL_S)


def stderr_lines(proc: subprocess.Popen, out: list[tuple[float, str]]) -> None:
    for line in proc.stderr:
        out.append((time.time(), line))


def one_run(run_dir: Path, *, kill_step: int, timeout_s: float) -> dict[str, float]:
    """Train with an injected SIGKILL; returns each milestone's wall-clock time."""
    fields = {
        **PLAIN_FIELDS,
        "run.dir": str(run_dir),
        "training.steps": str(kill_step + 2),
        "checkpoint.interval_steps": str(kill_step - 1),
        "debug.fail_at_step": str(kill_step),
        "debug.fail_rank": "1",
        "debug.fail_mode": "kill",
    }
    args = [sys.executable, "-m", "distrain", "train", "--nproc", str(NUM_RANKS)]
    args += ["--max-restarts", "1"]
    for key, value in fields.items():
        args += [f"--{key}", value]
    run_dir.mkdir(parents=True)
    poller = MetricsPoller(run_dir / "metrics.jsonl")
    poller.start()
    env = dict(os.environ, PYTHONUNBUFFERED="1", LOGLEVEL="INFO", OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        args, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env
    )
    agent_lines: list[tuple[float, str]] = []
    reader = threading.Thread(target=stderr_lines, args=(proc, agent_lines), daemon=True)
    reader.start()
    try:
        proc.wait(timeout=timeout_s)
    finally:
        proc.kill()
        reader.join()
        poller.done.set()
        poller.join()
    if proc.returncode != 0:
        tail = "".join(line for _, line in agent_lines[-40:])
        raise RuntimeError(f"training exited with {proc.returncode}:\n{tail}")

    logs = run_dir / "logs"
    kill = log_times(logs / "rank1.log", f"crashes at step {kill_step} (kill)")[-1]
    detected = first_after(
        [t for t, line in agent_lines if "Worker group FAILED" in line], kill, "failure report"
    )
    rendezvous = first_after(
        [t for t, line in agent_lines if "Rendezvous complete" in line], detected, "rendezvous"
    )
    step_times = [r["step_time_s"] for _, r in poller.rows if "step_time_s" in r]
    return {
        "kill": kill,
        "detected": detected,
        "rendezvous": rendezvous,
        "workers_up": first_after(log_times(logs / "rank0.log", "rank 0/"), kill, "worker start"),
        "resumed": first_after(log_times(logs / "rank0.log", "resumed from"), kill, "resume"),
        "first_step": first_after(
            [t for t, row in poller.rows if row.get("step") == kill_step and "loss" in row],
            kill,
            f"step {kill_step} row",
        ),
        "median_step_s": statistics.median(step_times),
    }


def inprocess_run(
    root: Path, *, kill_step: int, timeout_s: float, heartbeat_ms: int | None
) -> dict[str, float]:
    """2 replica groups of 1 rank; SIGKILL group 1's worker once group 0 logged step K-1."""
    root.mkdir(parents=True)
    lighthouse = _start_lighthouse(root / "lighthouse.log", heartbeat_ms)
    address = lighthouse.stdout.readline().strip()
    # The lighthouse's address is this host's name, not loopback: the groups need a run secret.
    secret = root / "run-secret"
    secret.write_text(secrets.token_hex(32))
    secret.chmod(0o600)
    # Enough steps after the kill for group 1's worker to restart and rejoin while group 0 trains.
    steps = kill_step + INPROCESS_STEPS_AFTER_KILL
    fields = {
        **PLAIN_FIELDS,
        "training.steps": str(steps),
        "fault_tolerance.replica_groups": "2",
        "fault_tolerance.lighthouse": address,
        "fault_tolerance.timeout_s": "5",
        "fault_tolerance.secret_file": str(secret),
    }
    procs, pollers = [], []
    # One CPU thread per group, as the restart path's 2 ranks have: 2 groups of 2 threads
    # each would oversubscribe the 2 cores and slow every step.
    env = dict(os.environ, PYTHONUNBUFFERED="1", RUST_LOG="info", OMP_NUM_THREADS="1")
    try:
        for group in range(2):
            run_dir = root / f"group{group}"
            run_dir.mkdir(parents=True)
            args = [sys.executable, "-m", "distrain", "train", "--nproc", "1"]
            args += ["--max-restarts", "1", "--fault_tolerance.group", str(group)]
            for key, value in {**fields, "run.dir": str(run_dir)}.items():
                args += [f"--{key}", value]
            pollers.append(MetricsPoller(run_dir / "metrics.jsonl"))
            pollers[-1].start()
            with open(root / f"group{group}.stderr", "w") as stderr:
                procs.append(
                    subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=stderr, env=env)
                )
        deadline = time.monotonic() + timeout_s

        def trained(group: int) -> list[tuple[float, dict[str, Any]]]:
            return [(t, r) for t, r in pollers[group].rows if "loss" in r]

        while not any(r["step"] >= kill_step - 1 for _, r in trained(0)) or not trained(1):
            if time.monotonic() > deadline or procs[0].poll() is not None:
                raise RuntimeError("group 0 never reached the kill step")
            time.sleep(POLL_S)
        victim = _only_worker(procs[1].pid)
        kill = time.time()
        os.kill(victim, signal.SIGKILL)
        for proc in procs:
            proc.wait(timeout=max(deadline - time.monotonic(), 1))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        for poller in pollers:
            poller.done.set()
            poller.join()
        lighthouse.kill()
        lighthouse.wait()
    if procs[0].returncode != 0:
        raise RuntimeError(f"group 0 exited with {procs[0].returncode}")
    rows0 = [r for _, r in pollers[0].rows]
    # The kill's row: the first change group 0 logged (a group evicted later, long after the
    # kill, as on an overloaded host, is counted in "changes").
    changes = [r for r in rows0 if "replica_change" in r]
    lost = changes[0]
    rejoined = [r for _, r in pollers[1].rows if r.get("replica_change") == "rejoined"]
    logged = [r["step"] for r in rows0 if "loss" in r]
    first_step = min(t for t, r in trained(0) if t >= kill)
    nan = float("nan")
    return {
        **recovery_timeline(root, kill=kill, first_step=first_step),
        "total": first_step - kill,
        "recovery_s (metrics row)": lost["recovery_s"],
        "steps recomputed": len(logged) - len(set(logged)),
        "rejoin transfer": rejoined[-1]["transfer_s"] if rejoined else nan,
        "state MiB": rejoined[-1]["state_mb"] if rejoined else nan,
        "steady step": statistics.median(
            r["step_time_s"] for r in rows0 if "step_time_s" in r and 2 < r["step"] < kill_step - 1
        ),
        "changes": len(changes),
        **steady_step_parts(_torchft_log(root, 0), kill=kill),
    }


def torchft_times(path: Path, needle: str) -> list[tuple[float, str]]:
    """(wall-clock time, line) of each torchft log line (Rust, RUST_LOG=info) with `needle`."""
    out = []
    for line in path.read_text().splitlines():
        if needle in line and line[:4].isdigit():
            stamp = datetime.strptime(line.split(" ", 1)[0], TORCHFT_TIME_FORMAT)
            out.append((stamp.timestamp(), line))
    return out


def _torchft_log(root: Path, group: int) -> Path:
    """Where group `group`'s rank 0 writes torchft's own log lines: its rank log (a worker that
    `distrain train` started sends the native stderr there, observe/logs.py)."""
    return root / f"group{group}" / "logs" / "rank0.log"


def recovery_timeline(root: Path, *, kill: float, first_step: float) -> dict[str, float]:
    """Seconds of each phase from the kill to group 0's next completed step, from torchft's
    logs: group 0's manager (its vote, its quorum) and the lighthouse (its heartbeat count). A
    kill that lands between two steps has no failed vote: its "error" phase is then 0."""
    log0 = _torchft_log(root, 0)
    failed = [t for t, _ in torchft_times(log0, "should_commit=false") if t >= kill]
    quorums = [
        t
        for t, line in torchft_times(log0, "got lighthouse quorum")
        if t >= kill and not re.search(r'replica_id: "[^"]*group1:', line)
    ]
    if not quorums:
        raise RuntimeError("no quorum without group 1 after the kill; did torchft's log change?")
    quorum = quorums[0]
    error = failed[0] if failed and failed[0] <= quorum else quorum
    vote = first_after(
        [t for t, _ in torchft_times(log0, "should_commit=true")], quorum, "committed vote"
    )
    gone = [
        datetime.strptime(line[:23], LIGHTHOUSE_TIME_FORMAT).timestamp()
        for line in (root / "lighthouse.log").read_text().splitlines()
        if "refuses connections: gone" in line
    ]
    dropped = first_after(gone, kill, "group 1 found gone")
    return {
        "kill->error": error - kill,
        "error->quorum": quorum - error,
        "quorum->redone vote": vote - quorum,
        "vote->step row": first_step - vote,
        "kill->found gone": dropped - kill,
    }


def steady_step_parts(log: Path, *, kill: float) -> dict[str, float]:
    """Medians over group 0's steps before the kill, from its manager's log: the quorum (the
    lighthouse round trip, and the wait for the other group to reach its step boundary), the
    step up to the vote (forward, backward, the average between groups) and the rest (optimizer
    step, metrics) up to the next quorum. Each vote is paired with the quorum before it (the
    groups' gathering before step 1 is several quorums with no vote)."""
    starts = [t for t, _ in torchft_times(log, "Start quorum") if t < kill]
    finished = [t for t, _ in torchft_times(log, "Finished quorum") if t < kill]
    votes = [t for t, _ in torchft_times(log, "should_commit request") if t < kill]
    steps = []
    # The first step waits for the gathering; the last vote before the kill may lack a next.
    for vote, next_vote in zip(votes[1:], votes[2:], strict=False):
        start = max(t for t in starts if t < vote)
        done = max(t for t in finished if t < vote)
        after = min(t for t in starts if t > vote)
        if after < next_vote:
            steps.append((start, done, vote, after))
    return {
        "step: quorum": statistics.median(f - s for s, f, _, _ in steps),
        "step: compute+average": statistics.median(v - f for _, f, v, _ in steps),
        "step: after vote": statistics.median(n - v for _, _, v, n in steps),
    }


def plain_run(root: Path, *, steps: int, timeout_s: float) -> dict[str, float]:
    """The same 2 ranks as one run without replica groups (ZeRO-3, one thread each): its
    median step over the steps the in-process path's steady step is taken from."""
    root.mkdir(parents=True)
    args = [sys.executable, "-m", "distrain", "train", "--nproc", str(NUM_RANKS)]
    for key, value in {**PLAIN_FIELDS, "training.steps": str(steps), "run.dir": str(root)}.items():
        args += [f"--{key}", value]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(args, capture_output=True, text=True, env=env, timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"the plain run exited with {proc.returncode}:\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (root / "metrics.jsonl").open()]
    return {
        "steady step": statistics.median(
            r["step_time_s"] for r in rows if "step_time_s" in r and 2 < r["step"] < steps - 1
        )
    }


def _start_lighthouse(log: Path, heartbeat_ms: int | None) -> subprocess.Popen:
    """`distrain lighthouse` in a process of its own, as a real run has it, logging (ms
    timestamps) to `log`; its first stdout line is its address."""
    args = [sys.executable, "-m", "distrain", "lighthouse", "--bind", "[::]:0"]
    if heartbeat_ms is not None:
        args += ["--heartbeat-timeout-ms", str(heartbeat_ms)]
    with open(log, "w") as stderr:
        return subprocess.Popen(
            args,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )


def _only_worker(agent_pid: int) -> int:
    """The pid of the one worker under a `distrain train --nproc 1` launcher."""
    for _ in range(200):
        children = []
        for task in Path(f"/proc/{agent_pid}/task").iterdir():
            children += [int(c) for c in (task / "children").read_text().split()]
        workers = [
            c for c in children if b"distrain.train" in Path(f"/proc/{c}/cmdline").read_bytes()
        ]
        if workers:
            return workers[0]
        time.sleep(0.05)
    raise RuntimeError("no worker under the launcher")


def breakdown(times: dict[str, float]) -> dict[str, float]:
    """Seconds spent in each phase, and the total from the kill to the first completed step."""
    out, start = {}, times["kill"]
    for phase, milestone in PHASES:
        out[phase] = times[milestone] - start
        start = times[milestone]
    out["total"] = times["first_step"] - times["kill"]
    out["steady step"] = times["median_step_s"]
    return out


def state_protection(megabytes: float = 16.0, repeats: int = 5) -> dict[str, float]:
    """MB/s of `torch.save` of a state of `megabytes`, and of sealing and opening its bytes
    as the live-state transport does (the best of `repeats` each)."""
    import io

    from distrain.ft.transport import seal, unseal

    state = {"w": torch.randn(int(megabytes * 2**20) // 4)}
    secret, nonce = b"s" * 32, "ab" * 32

    def best(work) -> float:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            work()
            times.append(time.perf_counter() - start)
        return megabytes / min(times)

    buffer = io.BytesIO()
    torch.save(state, buffer)
    body = buffer.getvalue()
    sealed = seal(secret, 0, 0, 7, nonce, body)
    return {
        "state_mb": megabytes,
        "torch_save_mb_s": best(lambda: torch.save(state, io.BytesIO())),
        "seal_mb_s": best(lambda: seal(secret, 0, 0, 7, nonce, body)),
        "open_mb_s": best(lambda: unseal(secret, 0, 0, 7, nonce, sealed)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="Runs to take the median over.")
    parser.add_argument("--kill-step", type=int, default=5, help="Step at whose start rank 1 dies.")
    parser.add_argument(
        "--inprocess-kill-step",
        type=int,
        default=25,
        help="Step of group 0 before which group 1's worker is killed (the steps before it give "
        "the steady step).",
    )
    parser.add_argument("--timeout-s", type=float, default=240, help="Limit for one run.")
    parser.add_argument("--out", default="benchmarks/results/recovery.json")
    parser.add_argument(
        "--paths",
        default="restart,plain,inprocess",
        help="Comma-separated: restart, plain (no fault, no replica groups), inprocess.",
    )
    parser.add_argument(
        "--heartbeat-ms",
        default="",
        help="Comma-separated lighthouse heartbeat timeouts for the in-process path, each its "
        "own column (default: distrain lighthouse's).",
    )
    parser.add_argument(
        "--protection-only",
        action="store_true",
        help="Only measure what sealing the live state costs (state_protection), no runs.",
    )
    ns = parser.parse_args()
    if ns.protection_only:
        protection = state_protection()
        print("live-state protection (MB/s):", protection)
        write_json(ns.out, {"state_protection": protection, "torch": torch.__version__})
        return
    if ns.kill_step < 2:
        parser.error("--kill-step must be >= 2 (a checkpoint must precede the kill)")
    beats = [int(b) for b in ns.heartbeat_ms.split(",")] if ns.heartbeat_ms else [None]
    paths = [
        (path, beat)
        for path in ns.paths.split(",")
        for beat in (beats if path == "inprocess" else [None])
    ]

    def name(path: str, beat: int | None) -> str:
        return path if beat is None else f"{path} ({beat} ms)"

    tmp = Path(tempfile.mkdtemp(prefix="distrain-recovery-"))
    runs: dict[str, list[dict[str, float]]] = {name(*p): [] for p in paths}
    try:
        for i in range(ns.runs):
            for path, beat in paths:  # interleaved: every path sees the same machine load
                where = tmp / f"{path}{beat}-{i}"
                if path == "restart":
                    times = one_run(where, kill_step=ns.kill_step, timeout_s=ns.timeout_s)
                    runs[path].append(breakdown(times))
                elif path == "plain":
                    runs[path].append(
                        plain_run(where, steps=ns.inprocess_kill_step, timeout_s=ns.timeout_s)
                    )
                else:
                    runs[name(path, beat)].append(
                        inprocess_run(
                            where,
                            kill_step=ns.inprocess_kill_step,
                            timeout_s=ns.timeout_s,
                            heartbeat_ms=beat,
                        )
                    )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    medians = {
        path: {key: statistics.median(run[key] for run in rows) for key in rows[0]}
        for path, rows in runs.items()
    }
    for path, rows in runs.items():
        columns = list(medians[path])
        print(f"\n{path} path")
        print(f"{'run':<8}" + "".join(f"{c:>26}" for c in columns))
        for label, row in [
            *((str(i + 1), r) for i, r in enumerate(rows)),
            ("median", medians[path]),
        ]:
            print(f"{label:<8}" + "".join(f"{row[c]:>26.3f}" for c in columns))
    median = medians.get("restart", {})

    result = {
        "config": {
            "ranks": NUM_RANKS,
            "preset": "tiny",
            "kill_step": ns.kill_step,
            "checkpoint_step": ns.kill_step - 1,
            "global_batch_size": 8,
            "micro_batch_size": 2,
            "seq_len": 64,
            "zero_stage": 3,
            "threads_per_rank": 1,
            "backend": "gloo",
            "launch": "distrain train --nproc 2 --max-restarts 1 (standalone)",
            "torch": torch.__version__,
            "cpus": os.cpu_count(),
        },
        "phases": [phase for phase, _ in PHASES],
        "runs_s": runs.get("restart", []),
        "median_s": median,
        "inprocess": {
            "launch": "2 x distrain train --nproc 1 --max-restarts 1, replica_groups 2, zero 3, "
            "OMP_NUM_THREADS=1",
            "kill_step": ns.inprocess_kill_step,
            "steps_after_kill": INPROCESS_STEPS_AFTER_KILL,
            "lighthouse": {
                "join_timeout_s": DEFAULT_JOIN_TIMEOUT_S,
                "heartbeat_timeout_ms": DEFAULT_HEARTBEAT_TIMEOUT_MS,
            },
            "settings": {
                name(path, beat): {"heartbeat_timeout_ms": beat or DEFAULT_HEARTBEAT_TIMEOUT_MS}
                for path, beat in paths
                if path == "inprocess"
            },
            "runs": {k: v for k, v in runs.items() if k.startswith("inprocess")},
            "median": {k: v for k, v in medians.items() if k.startswith("inprocess")},
            "plain_runs": runs.get("plain", []),
            "plain_median": medians.get("plain", {}),
        },
    }
    result["state_protection"] = state_protection()
    print("\nlive-state protection (MB/s):", result["state_protection"])
    write_json(ns.out, result)


if __name__ == "__main__":
    main()
