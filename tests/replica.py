"""What the replica-group tests share: `distrain lighthouse` (torchft's lighthouse, with its
default timeouts) in a process of its own (as on a cluster; torchft stays out of the test
process, which trains in-process), a run's
metrics rows read while it writes them, the check of a killed group's membership row, and a
wait that fails as soon as a group's launcher ends, and the run secret the groups share; the
groups' start, the end of a run whose group 0 is the survivor, and the groups' launchers reaped
however a test ends."""

from __future__ import annotations

import contextlib
import json
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

PACED_GROUPS = {
    "parallel__zero_stage": 3,
    "fault_tolerance__replica_groups": 2,
    # Above the time a rejoining group takes to load the live state on a busy 2-core machine
    # (a shorter one makes both groups redo that step: a "retried" row, still exact).
    "fault_tolerance__timeout_s": 6,
    # A rank whose peer in its own group hangs gives up after this, and its group restarts;
    # longer than fault_tolerance.timeout_s, so that group 0 sees the hang as a timeout.
    "comm__collective_timeout_s": 12,
    "checkpoint__preempt_grace_s": 1,
    # Paces the steps: rank 0 of each group sleeps debug.slow_ms (each test's own) in each
    # step's data phase, so that group 0 is still training when group 1's workers are back.
    "debug__slow_rank": 0,
}
"""Two replica groups of ZeRO-3, timed for a rejoin on a busy machine; add debug__slow_ms."""

LIGHTHOUSE = [sys.executable, "-m", "distrain", "lighthouse", "--bind", "[::]:0"]
"""`distrain lighthouse` on a free port, default timeouts; its first stdout line is its address."""


@contextlib.contextmanager
def running_lighthouse() -> Iterator[str]:
    """`distrain lighthouse` in a process of its own on this host, on a free port; yields its
    address."""
    server = subprocess.Popen(
        LIGHTHOUSE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        yield server.stdout.readline().strip()
    finally:
        server.terminate()
        server.wait()


def secret_file(folder: Path) -> str:
    """A run secret for fault_tolerance.secret_file (the tests' lighthouse is not on a loopback
    address, so the groups need one): random, owner-only."""
    path = folder / "run-secret"
    path.write_text(secrets.token_hex(32))
    path.chmod(0o600)
    return str(path)


def metrics_rows(run_dir: Path) -> list[dict]:
    """The run's metrics rows so far (a line still being written is left out)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def trained_step(run_dir: Path) -> int:
    """The last step the run has logged a loss for so far (0 before any)."""
    return max((r["step"] for r in metrics_rows(run_dir) if "loss" in r), default=0)


def check_killed_group_row(rows: list[dict], ranks_lost: str) -> dict:
    """The survivors' row for a group whose process was killed (the first failure row with the
    cause "collective error"), checked; returned. The step in flight fails with a collective
    error, and the survivors redo it over the same global batch with the groups in the next
    quorum: without the killed group ("lost") when the lighthouse has dropped it by then, or
    with it ("retried") when its restarted processes were back first and took the live state."""
    (row, *_) = [
        r
        for r in rows
        if r.get("replica_change") in ("lost", "retried") and r["cause"] == "collective error"
    ]
    assert row["steps_lost"] == 0 and 0 < row["recovery_s"] < 30, row
    if row["replica_change"] == "lost":
        assert row["replica_groups_lost"] == "1" and row["ranks_lost"] == ranks_lost, row
        assert row["replica_groups"] == 1, row
        # The killed group came back later: a "joined" row names the last step before the join
        # (a "lost" row the step redone), so a group back right after the redone step has its
        # step.
        assert any(r.get("replica_change") == "joined" and r["step"] >= row["step"] for r in rows)
    else:
        assert row["replica_groups"] == 2, row
    return row


def start_groups(
    runs: list[Path], lighthouse: str, secret: Path, *, nproc: int = 1, max_restarts: int, **fields
) -> list[subprocess.Popen]:
    """`distrain train` of replica group g in run dir runs[g], for every g: `nproc` ranks each,
    around `lighthouse`, with the run secret file `secret`."""
    from helpers import start_train

    return [
        start_train(
            run,
            "--nproc",
            str(nproc),
            "--max-restarts",
            str(max_restarts),
            **fields,
            fault_tolerance__group=g,
            fault_tolerance__lighthouse=lighthouse,
            fault_tolerance__secret_file=secret,
        )
        for g, run in enumerate(runs)
    ]


@contextlib.contextmanager
def reaped(procs: list[subprocess.Popen]) -> Iterator[list[subprocess.Popen]]:
    """`procs`, each launcher still running on exit killed and reaped, however the block ends,
    so that no group outlives its test (a launcher added to the list inside the block too)."""
    try:
        yield procs
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()


def survivor_ends(procs: list[subprocess.Popen], *, timeout_s: float, others_s: float) -> str:
    """Group 0's stderr once its launcher ends (within timeout_s); each other group is then given
    others_s to end (a group that was killed may still be rejoining, or training alone after
    group 0 finished: not what these tests check), and is left to `reaped` after that."""
    _, err = procs[0].communicate(timeout=timeout_s)
    for proc in procs[1:]:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.communicate(timeout=others_s)
    return err


def wait_until(condition, what: str, procs, limit_s: float) -> None:
    """Poll `condition` until it holds; fail when any of `procs` ends first, or after limit_s."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if condition():
            return
        if any(p.poll() is not None for p in procs):
            raise AssertionError(f"a group's launcher ended while waiting for {what}")
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")
