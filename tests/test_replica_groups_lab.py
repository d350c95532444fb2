"""Replica groups across 2 hosts of the network lab (tests/netlab.py): 2 groups x 1 rank, group 0
and the torchft lighthouse on host 0, group 1 on host 1, their gradients averaged by gloo over
the lab link. Once step 3 is logged, every process of host 1 (its `distrain train` and its
worker) gets a SIGKILL; host 1's group is then started again (a new `distrain train`, its own run
dir) and rejoins with group 0's live state. A few steps later host 1's link is set down with its
processes alive: group 0 evicts it on the collective's timeout and goes on alone; once group 0
has done so the link is set up again, and host 1's group, still the same process, rejoins in
place with group 0's live state and trains on at group 0's step numbers. Group 0 is never
restarted (same pids), and every step's loss of every group is the uninterrupted 1-process
run's within 5e-6 (relative). That is this layout's fp32 floor with margin, not the recovery's:
two 1-rank groups average their gradients in another order than one process sums them, and a
run measured 1.3e-6 at most, 0 at half the steps, and no drift.
A lost, skipped or doubled step moves the loss by a step's progress: 1.2e-3 to 0.26
(median 4.5e-2) from one step to the next of the 1-process run.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import SMALL_RUN, losses, overrides, train_in_process, worker_pid
from netlab import IFNAME, lab_available, net_lab
from replica import (
    LIGHTHOUSE,
    check_killed_group_row,
    metrics_rows,
    secret_file,
    trained_step,
    wait_until,
)

from distrain.observe.metrics import read_metrics

_wait = functools.partial(wait_until, limit_s=120)

if importlib.util.find_spec("torchft") is None:
    pytest.skip("torchft is not installed (the ft extra)", allow_module_level=True)

STEPS = 40
REL = 5e-6
FIELDS = {
    "training__steps": STEPS,
    **SMALL_RUN,
    "checkpoint__interval_steps": 0,
    "checkpoint__at_end": False,
}
GROUP_FIELDS = {
    **FIELDS,
    "parallel__zero_stage": 3,
    "fault_tolerance__replica_groups": 2,
    # Above the time a rejoining group takes to load the live state on a busy 2-core machine.
    "fault_tolerance__timeout_s": 6,
    # Paces the steps so that group 0 is still training when host 1's group is back.
    "debug__slow_rank": 0,
    "debug__slow_ms": 400,
}


def _changes(run_dir: Path, change: str) -> list[dict]:
    return [r for r in metrics_rows(run_dir) if r.get("replica_change") == change]


def _host_pids(lab, i: int) -> list[int]:
    out = subprocess.run(
        ["ip", "netns", "pids", lab.hosts[i].ns], capture_output=True, text=True, timeout=30
    ).stdout
    return [int(pid) for pid in out.split()]


def _set_link(lab, i: int, state: str) -> None:
    """Host i's lab0 "down" or "up"; its processes go on, cut off from the other host."""
    subprocess.run(
        ["ip", "-n", lab.hosts[i].ns, "link", "set", IFNAME, state], check=True, timeout=30
    )


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("reference")
    train_in_process(run, **FIELDS)
    return run


@pytest.fixture(scope="module")
def lab_run(tmp_path_factory) -> dict:
    reason = lab_available()
    if reason is not None:
        pytest.skip(reason)
    root = tmp_path_factory.mktemp("lab-groups")
    runs = {name: root / name for name in ("group0", "group1", "again")}
    secret = secret_file(root)
    with net_lab(2, rate="1gbit") as lab:
        server = lab.run(
            0,
            LIGHTHOUSE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        lighthouse = server.stdout.readline().strip()

        def group(name: str, g: int) -> subprocess.Popen:
            """`distrain train` of replica group g on host g; its stderr in ROOT/NAME.stderr."""
            argv = [sys.executable, "-m", "distrain", "train", "--nproc", "1"]
            fields = dict(
                GROUP_FIELDS,
                fault_tolerance__group=g,
                fault_tolerance__lighthouse=lighthouse,
                fault_tolerance__secret_file=secret,
            )
            for key, value in overrides(runs[name], **fields):
                argv += [f"--{key}", value]
            with (root / f"{name}.stderr").open("w") as log:
                return lab.run(g, argv, env={"PYTHONUNBUFFERED": "1"}, stdout=log, stderr=log)

        first, second = group("group0", 0), group("group1", 1)
        _wait(
            lambda: trained_step(runs["group0"]) >= 3 and trained_step(runs["group1"]) >= 3,
            "step 3 in both groups",
            [first, second],
        )
        survivors = (first.pid, worker_pid(first.pid, 0))
        killed = _host_pids(lab, 1)
        for pid in killed:
            os.kill(pid, signal.SIGKILL)
        second.wait(timeout=30)
        _wait(lambda: not _host_pids(lab, 1), "host 1's processes to end", [first], limit_s=30)
        again = group("again", 1)
        _wait(
            lambda: _changes(runs["again"], "rejoined"), "the new group 1's rejoin", [first, again]
        )
        survivors_late = (first.pid, worker_pid(first.pid, 0))
        # The cut: host 1's link down with its group alive, until group 0 has evicted it.
        rejoined_at = _changes(runs["again"], "rejoined")[0]["step"]
        _wait(
            lambda: trained_step(runs["again"]) >= rejoined_at + 2,
            "steps after the rejoin",
            [first, again],
        )
        cut_off = (again.pid, worker_pid(again.pid, 0))
        evicted_before = len(_changes(runs["group0"], "lost"))
        _set_link(lab, 1, "down")
        _wait(
            lambda: len(_changes(runs["group0"], "lost")) > evicted_before,
            "group 0 to evict the cut-off group",
            [first, again],
            limit_s=60,
        )
        _set_link(lab, 1, "up")
        _wait(
            lambda: len(_changes(runs["again"], "rejoined")) >= 2,
            "the cut-off group's rejoin",
            [first, again],
        )
        cut_off_late = (again.pid, worker_pid(again.pid, 0))
        survivors_after_cut = (first.pid, worker_pid(first.pid, 0))
        first.wait(timeout=180)
        again.wait(timeout=60)
        sent = [lab.sent_bytes(i) for i in (0, 1)]
    return {
        "runs": runs,
        "survivors": survivors,
        "survivors_late": survivors_late,
        "survivors_after_cut": survivors_after_cut,
        "cut_off": cut_off,
        "cut_off_late": cut_off_late,
        "evicted_before": evicted_before,
        "killed": killed,
        "returncodes": (first.returncode, again.returncode),
        "sent": sent,
        "stderr": {name: (root / f"{name}.stderr").read_text()[-4000:] for name in runs},
    }


@pytest.mark.slow
@pytest.mark.requires("netlab")
def test_survivor_keeps_its_processes(lab_run):
    assert lab_run["returncodes"] == (0, 0), lab_run["stderr"]
    # Host 1 ran its torchrun agent and its worker: both were killed.
    assert len(lab_run["killed"]) == 2, lab_run["killed"]
    assert None not in lab_run["survivors"]
    assert lab_run["survivors_late"] == lab_run["survivors"]
    assert lab_run["survivors_after_cut"] == lab_run["survivors"]
    rows = read_metrics(lab_run["runs"]["group0"] / "metrics.jsonl", all_attempts=True)
    assert not any("attempt" in r or "resumed_from" in r for r in rows)


@pytest.mark.slow
@pytest.mark.requires("netlab")
def test_every_step_matches_the_uninterrupted_run(lab_run, reference):
    want = losses(read_metrics(reference / "metrics.jsonl"))
    runs = lab_run["runs"]
    got = {name: losses(read_metrics(runs[name] / "metrics.jsonl")) for name in runs}
    # Every step from group 0's first to the last; a group 0 that started late joined with the
    # state of host 1's group, which trained every step before group 0's first alone.
    assert sorted(got["group0"]) == list(range(min(got["group0"]), STEPS + 1))
    assert set(range(1, min(got["group0"]))) <= set(got["group1"])
    # Host 1's first group trained until it was killed; the new one from its rejoin to the end.
    assert 3 <= max(got["group1"]) < STEPS
    # The new one from its rejoin to the cut, then from its heal to the end at group 0's step
    # numbers, each step once.
    rejoined, healed = _changes(runs["again"], "rejoined")
    logged = [r["step"] for r in metrics_rows(runs["again"]) if "loss" in r]
    assert len(logged) == len(set(logged)), logged
    before = [s for s in sorted(logged) if s <= healed["step"]]
    assert before == list(range(rejoined["step"] + 1, max(before) + 1)), logged
    assert sorted(logged)[len(before) :] == list(range(healed["step"] + 1, STEPS + 1)), logged
    for name, curve in got.items():
        for step, loss in curve.items():
            assert abs(loss - want[step]) <= REL * abs(want[step]), (name, step, loss, want[step])


@pytest.mark.slow
@pytest.mark.requires("netlab")
def test_membership_changes_are_metrics_rows(lab_run):
    rows = metrics_rows(lab_run["runs"]["group0"])
    # The killed host's group, first (a group stalled past fault_tolerance.timeout_s on a
    # saturated machine can also be evicted once with no fault injected, then rejoin, still
    # exact: a later row, not counted here).
    check_killed_group_row(rows, ranks_lost="1")
    rejoined, healed = _changes(lab_run["runs"]["again"], "rejoined")
    assert rejoined["state_mb"] > 1 and rejoined["transfer_s"] > 0 and rejoined["step"] > 3


@pytest.mark.slow
@pytest.mark.requires("netlab")
def test_the_cut_off_group_is_evicted_and_heals_in_place(lab_run):
    runs = lab_run["runs"]
    # Host 1's group lived through the cut: the same launcher and worker, no restart.
    assert None not in lab_run["cut_off"]
    assert lab_run["cut_off_late"] == lab_run["cut_off"]
    again = read_metrics(runs["again"] / "metrics.jsonl", all_attempts=True)
    assert not any("attempt" in r or "resumed_from" in r for r in again)
    # Group 0 evicted it on the collective's timeout and took it back.
    evicted = _changes(runs["group0"], "lost")[lab_run["evicted_before"]]
    assert evicted["cause"] == "timeout", evicted
    assert evicted["replica_groups_lost"] == "1" and evicted["replica_groups"] == 1
    assert evicted["steps_lost"] == 0
    assert any(
        r.get("replica_change") == "joined" and r["step"] > evicted["step"]
        for r in metrics_rows(runs["group0"])
    )
    # It loaded group 0's live state in place, at group 0's step, and reports no recovery
    # of its own: the quorum that healed it redid none of its attempts.
    rejoined, healed = _changes(runs["again"], "rejoined")
    assert healed["step"] >= evicted["step"] and healed["state_mb"] > 1, healed
    assert not _changes(runs["again"], "retried"), metrics_rows(runs["again"])


@pytest.mark.slow
@pytest.mark.requires("netlab")
def test_the_groups_averaged_over_the_lab_link(lab_run):
    # Each step both groups trained sends at least the tiny model's fp32 gradients (3.4 MB) each
    # way; host 1's groups trained together with group 0 for at least this many steps.
    together = len(losses(metrics_rows(lab_run["runs"]["group1"]))) - 1
    together += len(losses(metrics_rows(lab_run["runs"]["again"])))
    assert min(lab_run["sent"]) > together * 3_000_000, (lab_run["sent"], together)
