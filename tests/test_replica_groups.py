"""Replica groups that survive each other (fault_tolerance.replica_groups, on torchft).

One run of 4 ranks as 2 replica groups x 2 (ZeRO-3 inside each), each group its own
`distrain train --nproc 2` (torchrun), around a torchft lighthouse this module starts. Two
failures in a row, from outside: a SIGKILL of a rank of group 1 once step 3 is logged; once
group 1's restarted workers have rejoined with the live state, a SIGSTOP of one of them (a
hang), which group 0 detects by fault_tolerance.timeout_s and evicts (the stopped process is
then killed, as a node's health check would: SIGSTOP has no end of its own). Group 0 is never
restarted; every step's loss of both groups is the uninterrupted 1-process run's within 1e-6
(relative; the survivors add the same micro-batch terms in another order), the final weights of
both groups are bit-identical to those of an uninterrupted 2-rank ZeRO-3 run (one group's
layout, no replica groups) and within 2e-5 of the 1-process run's (relative to each tensor's
norm: AdamW amplifies the fp32 reorderings of that layout in rarely updated elements).

Two more runs: 4 groups of 1 rank, two of them SIGKILLed in one step and a third while one of
those is on its way back (no step lost, the 1-process curve); and 3 groups with no fault, started
seconds apart beside busy processes, with no membership change at all.

The in-process tests check the loader's re-planning (the survivors read exactly the global
batch; without it they would read only their own shares) and the one-line refusals.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import SMALL_RUN, losses, start_train, train_cli, train_in_process, worker_pid
from replica import (
    PACED_GROUPS,
    check_killed_group_row,
    metrics_rows,
    reaped,
    running_lighthouse,
    secret_file,
    start_groups,
    survivor_ends,
    trained_step,
    wait_until,
)
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from distrain.config.io import load_config
from distrain.data.dataset import TokenDataset
from distrain.data.loader import DistributedBatchLoader
from distrain.errors import ConfigError
from distrain.observe.metrics import read_metrics

_wait = functools.partial(wait_until, limit_s=240)

if importlib.util.find_spec("torchft") is None:
    pytest.skip("torchft is not installed (the ft extra)", allow_module_level=True)

STEPS = 60
REL = 1e-6
# Four groups whose membership changes at times the kills decide: each step's gradient is summed
# over the groups live at that step, in an order the 1-process run never uses, and AdamW carries
# those fp32 reorderings on. Measured up to 1.06e-6 (step 30 of 40, in a clean-clone CI run): the
# bound is ten times that; the list of trained steps catches a lost or repeated step on its own.
FOUR_REL = 1e-5
WEIGHTS_REL = 2e-5
FIELDS = {
    "training__steps": STEPS,
    **SMALL_RUN,
    "checkpoint__interval_steps": 0,
    "checkpoint__at_end": True,
}
GROUP_FIELDS = {
    **FIELDS,
    **PACED_GROUPS,
    # Each group's final checkpoint is staged and written by a writer thread: the final
    # weights compared below are what it wrote.
    "checkpoint__async_mode": "thread",
    "debug__slow_ms": 600,
}


def _final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    out = run_dir / "final.pt"
    dcp_to_torch_save(run_dir / "checkpoints" / f"step-{STEPS:08d}", out)
    return torch.load(out, weights_only=False)["model"]


@pytest.fixture(scope="module")
def lighthouse():
    with running_lighthouse() as address:
        yield address


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("reference")
    train_in_process(run, **FIELDS)
    return run


@pytest.fixture(scope="module")
def zero3_reference(tmp_path_factory) -> Path:
    """The uninterrupted run of one group's layout: 2 ranks, ZeRO-3, no replica groups."""
    run = tmp_path_factory.mktemp("zero3")
    result = train_cli(run, 2, **FIELDS, parallel__zero_stage=3)
    assert result.returncode == 0, result.stderr[-3000:]
    return run


@pytest.fixture(scope="module")
def faulted(tmp_path_factory, lighthouse) -> dict:
    root = tmp_path_factory.mktemp("groups")
    runs = [root / f"group{g}" for g in range(2)]
    secret = secret_file(root)
    procs = start_groups(runs, lighthouse, secret, nproc=2, max_restarts=2, **GROUP_FIELDS)
    stopped = None
    with reaped(procs):

        def rejoins() -> int:
            return sum(r.get("replica_change") == "rejoined" for r in metrics_rows(runs[1]))

        _wait(
            lambda: trained_step(runs[0]) >= 3 and trained_step(runs[1]) >= 3,
            "step 3 in both groups",
            procs,
        )
        survivors = [worker_pid(procs[0].pid, rank, restart=0) for rank in (0, 1)]
        os.kill(worker_pid(procs[1].pid, 1, restart=0), signal.SIGKILL)
        _wait(lambda: rejoins() >= 1, "group 1's first rejoin", procs)
        rejoined_at = trained_step(runs[0])
        _wait(
            lambda: trained_step(runs[1]) >= rejoined_at + 2,
            "2 steps of the rejoined group",
            procs,
        )
        stopped = worker_pid(procs[1].pid, 1, restart=1)
        rows_before_stop = len(metrics_rows(runs[0]))
        os.kill(stopped, signal.SIGSTOP)
        _wait(
            lambda: any(
                r.get("replica_change") == "lost" for r in metrics_rows(runs[0])[rows_before_stop:]
            ),
            "group 1's eviction",
            procs,
        )
        os.kill(stopped, signal.SIGKILL)
        survivors_late = [worker_pid(procs[0].pid, rank, restart=0) for rank in (0, 1)]
        err0 = survivor_ends(procs, timeout_s=300, others_s=120)
    assert procs[0].returncode == 0, err0[-4000:]
    return {
        "runs": runs,
        "rows_before_stop": rows_before_stop,
        "survivors": survivors,
        "survivors_late": survivors_late,
        "console": err0,
    }


@pytest.mark.compat
def test_survivors_keep_their_processes(faulted):
    assert None not in faulted["survivors"]
    assert faulted["survivors_late"] == faulted["survivors"]
    rows = read_metrics(faulted["runs"][0] / "metrics.jsonl", all_attempts=True)
    assert not any("attempt" in r or "resumed_from" in r for r in rows)
    assert "resumed from" not in (faulted["runs"][0] / "logs" / "rank0.log").read_text()


def test_the_survivors_console_has_one_line_per_event(faulted):
    """torchft's tracebacks and gloo's raw errors of the kill and the hang stay in the rank
    logs; the console says each loss once, in one line."""
    console = faulted["console"]
    for noise in ("Traceback", "GLHF", "Connection closed by peer", "torchft"):
        assert noise not in console, console[-4000:]
    assert "without group(s) [1]" in console, console[-4000:]
    assert "not committed" not in console, console[-4000:]
    # The details: in the rank's log.
    assert "not committed" in (faulted["runs"][0] / "logs" / "rank0.log").read_text()


@pytest.mark.compat
def test_every_step_matches_the_uninterrupted_run(faulted, reference):
    want = losses(read_metrics(reference / "metrics.jsonl"))
    got0 = losses(read_metrics(faulted["runs"][0] / "metrics.jsonl"))
    got1 = losses(read_metrics(faulted["runs"][1] / "metrics.jsonl", all_attempts=True))
    # Every step from group 0's first to the last. A group that starts late (its launcher is
    # slower on a busy machine) joins with the state of the group already training: every step
    # before group 0's first is one group 1 trained alone.
    assert sorted(got0) == list(range(min(got0), STEPS + 1))
    assert set(range(1, min(got0))) <= set(got1), (min(got0), sorted(got1)[:5])
    # Group 1 was out for a while: group 0 alone trained those steps.
    assert len(got1) < len(got0)
    for got in (got0, got1):
        for step, loss in got.items():
            assert abs(loss - want[step]) <= REL * abs(want[step]), (step, loss, want[step])


@pytest.mark.compat
def test_final_weights_match_the_uninterrupted_run(faulted, reference, zero3_reference):
    want, same_layout = _final_weights(reference), _final_weights(zero3_reference)
    got, replacement = (_final_weights(run) for run in faulted["runs"])
    assert got.keys() == want.keys() == replacement.keys() == same_layout.keys()
    for name in want:
        # The replacement group holds exactly the survivors' weights, and they are bit for bit
        # the uninterrupted 2-rank ZeRO-3 run's: the failures, the redone steps and the rejoin
        # cost nothing in the weights.
        assert torch.equal(replacement[name], got[name]), name
        assert torch.equal(got[name], same_layout[name]), name
        # Against the 1-process run: AdamW divides each gradient element by its own running
        # magnitude, so the fp32 reorderings of the steps one group did alone (losses within
        # 1e-6) grow in the weights of rarely updated elements (embedding rows): measured
        # 5.8e-6 relative to the tensor's norm (1.5e-5 in one element) after 60 steps, exactly
        # the uninterrupted 2-rank ZeRO-3 run's distance: the floor is the layout's sum order.
        err = ((got[name] - want[name]).norm() / want[name].norm()).item()
        assert err <= WEIGHTS_REL, (name, err)


@pytest.mark.compat
def test_membership_changes_are_metrics_rows(faulted):
    rows = metrics_rows(faulted["runs"][0])
    # The SIGKILL: the step in flight redone without group 1 or with its restarted processes.
    killed = check_killed_group_row(rows, ranks_lost="2,3")
    # The SIGSTOP: the first eviction after it, on the collective's timeout (a group stalled
    # past fault_tolerance.timeout_s on a saturated machine can also be evicted with no fault
    # injected, each group then going on alone, still exact: not counted here).
    (hung, *_) = [
        r for r in rows[faulted["rows_before_stop"] :] if r.get("replica_change") == "lost"
    ]
    assert hung["cause"] == "timeout" and hung["step"] > killed["step"], hung
    assert hung["replica_groups_lost"] == "1" and hung["ranks_lost"] == "2,3"
    assert hung["steps_lost"] == 0 and hung["replica_groups"] == 1
    assert 0 < hung["recovery_s"] < 30
    retried = [r for r in rows if r.get("replica_change") == "retried"]
    assert all(r["steps_lost"] == 0 and r["replica_groups"] == 2 for r in retried)
    (rejoined, *_) = [
        r for r in metrics_rows(faulted["runs"][1]) if r.get("replica_change") == "rejoined"
    ]
    assert rejoined["state_mb"] > 1 and rejoined["transfer_s"] > 0


def test_status_and_diagnose_show_the_changes(faulted):
    from distrain.observe.diagnose import diagnose
    from distrain.observe.status import status

    for report in (status(faulted["runs"][0]), diagnose(faulted["runs"][0])):
        assert "replica groups: " in report
        assert (
            "lost replica group 1 (ranks 2,3): collective error" in report
            or "redone by every replica group (collective error;" in report
        ), report
        assert "lost replica group 1 (ranks 2,3): timeout" in report
        assert "0 step(s) lost" in report
    assert "this group rejoined with a peer's live state" in status(faulted["runs"][1])


# --- two failures at once, and a failure during a rejoin -------------------------------------

FOUR_STEPS = 40
FOUR_FIELDS = {
    **GROUP_FIELDS,
    "training__steps": FOUR_STEPS,
    # A multiple of micro-batch x lcm(1..4): any number of live groups splits it.
    "training__global_batch_size": 24,
    "fault_tolerance__replica_groups": 4,
    "checkpoint__async_mode": "off",
    "debug__slow_ms": 300,
}


@pytest.fixture(scope="module")
def four_reference(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("reference24")
    train_in_process(
        run, **{**FIELDS, "training__steps": FOUR_STEPS, "training__global_batch_size": 24}
    )
    return run


@pytest.fixture(scope="module")
def four_groups(tmp_path_factory, lighthouse) -> dict:
    """4 groups of 1 rank. Once every group has logged step 3, groups 2 and 3 are SIGKILLed
    back to back (the same step), their agents held until groups 0 and 1 have redone that step
    without them (as a slow node restart would); once group 2's restarted worker is up (on its
    way to rejoin with a peer's live state), group 1 is SIGKILLed too. Group 0 is never
    touched."""
    root = tmp_path_factory.mktemp("four")
    runs = [root / f"group{g}" for g in range(4)]
    secret = secret_file(root)
    procs = start_groups(runs, lighthouse, secret, max_restarts=2, **FOUR_FIELDS)

    with reaped(procs):
        _wait(
            lambda: all(trained_step(runs[g]) >= 3 for g in range(4)),
            "step 3 in every group",
            procs,
        )
        survivor = worker_pid(procs[0].pid, 0, restart=0)
        victims = [worker_pid(procs[g].pid, 0, restart=0) for g in (2, 3)]
        # Into step 4's paced data phase: killed before its quorum request reached the
        # lighthouse, a group would leave between steps ("left the quorum"), not in a step.
        time.sleep(FOUR_FIELDS["debug__slow_ms"] / 2000)
        # Their agents are held (SIGSTOP) until the survivors have redone the step without
        # them: a restart quicker than the survivors' new quorum would be taken into it, and
        # the step would be retried with groups 2 and 3 rather than redone without them.
        for g in (2, 3):
            os.kill(procs[g].pid, signal.SIGSTOP)
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        _wait(
            lambda: any(r.get("replica_change") == "lost" for r in metrics_rows(runs[0])),
            "the step redone without groups 2 and 3",
            procs[:2],
        )
        for g in (2, 3):
            os.kill(procs[g].pid, signal.SIGCONT)
        _wait(
            lambda: worker_pid(procs[2].pid, 0, restart=1) is not None,
            "group 2's restarted worker",
            procs[:2],
        )
        rejoined_before = any(r.get("replica_change") == "rejoined" for r in metrics_rows(runs[2]))
        os.kill(worker_pid(procs[1].pid, 0, restart=0), signal.SIGKILL)
        survivor_late = worker_pid(procs[0].pid, 0, restart=0)
        err0 = survivor_ends(procs, timeout_s=400, others_s=60)
    assert procs[0].returncode == 0, err0[-4000:]
    return {
        "runs": runs,
        "survivor": survivor,
        "survivor_late": survivor_late,
        "rejoined_before": rejoined_before,
    }


def test_two_failures_at_once_and_one_during_a_rejoin_lose_no_step(four_groups, four_reference):
    runs = four_groups["runs"]
    assert four_groups["survivor"] is not None
    assert four_groups["survivor_late"] == four_groups["survivor"]
    rows0 = read_metrics(runs[0] / "metrics.jsonl", all_attempts=True)
    assert not any("attempt" in r or "resumed_from" in r for r in rows0)
    trained = [r["step"] for r in rows0 if "loss" in r]
    # Every step once: none lost, none logged twice.
    assert trained == list(range(1, FOUR_STEPS + 1))
    want = losses(read_metrics(four_reference / "metrics.jsonl"))
    for g, run in enumerate(runs):
        got = losses(read_metrics(run / "metrics.jsonl", all_attempts=True))
        for step, loss in got.items():
            err = abs(loss - want[step])
            assert err <= FOUR_REL * abs(want[step]), (g, step, loss, want[step])
    changes = [r for r in rows0 if "replica_change" in r]
    assert all(r.get("steps_lost", 0) == 0 for r in changes), changes
    lost = {
        g
        for r in changes
        if r["replica_change"] == "lost"
        for g in map(int, r["replica_groups_lost"].split(","))
    }
    # Group 1 died while group 2 was on its way back.
    assert not four_groups["rejoined_before"]
    # Groups 2 and 3 left in one quorum (the step they died in, redone by groups 0 and 1),
    # group 1 later, while group 2 was coming back.
    first = next(r for r in changes if r["replica_change"] == "lost")
    assert first["replica_groups_lost"] == "2,3" and first["cause"] == "collective error", first
    assert lost == {1, 2, 3}, changes
    assert any(r.get("replica_change") == "rejoined" for r in metrics_rows(runs[2]))


# --- no fault: no membership change -----------------------------------------------------------

CALM_FIELDS = {
    **FIELDS,
    # A multiple of micro-batch x lcm(1..3): any number of live groups splits it.
    "training__global_batch_size": 12,
    "parallel__zero_stage": 3,
    "fault_tolerance__replica_groups": 3,
}


@contextlib.contextmanager
def _busy_cores(count: int):
    """`count` processes spinning beside the run, as other jobs on a shared host."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def test_three_groups_without_a_fault_never_change_membership(tmp_path, lighthouse):
    """3 groups of 1 rank, 60 steps, started seconds apart, on a machine loaded with 2 busy
    processes beside them (load over the 2 cores): the groups gather before their first step
    (no group trains alone and none joins later with a transfer), and no slow step evicts a
    live group. Every group logs every step, the same loss, and no membership change."""
    runs = [tmp_path / f"group{g}" for g in range(3)]
    secret = secret_file(tmp_path)
    procs = []
    with _busy_cores(2):
        with reaped(procs):
            for g in range(3):
                procs.append(
                    start_train(
                        runs[g],
                        "--nproc",
                        "1",
                        # Three groups on one host, a core's share each, as a user runs them.
                        env={"OMP_NUM_THREADS": "1"},
                        **CALM_FIELDS,
                        fault_tolerance__group=g,
                        fault_tolerance__lighthouse=lighthouse,
                        fault_tolerance__secret_file=secret,
                    )
                )
                time.sleep(3)
            outputs = [proc.communicate(timeout=600) for proc in procs]
    for proc, (_, err) in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, err[-3000:]
    rows = [read_metrics(run / "metrics.jsonl", all_attempts=True) for run in runs]
    changes = [r for group in rows for r in group if "replica_change" in r]
    assert changes == []
    curves = [losses(group) for group in rows]
    assert sorted(curves[0]) == list(range(1, STEPS + 1))
    assert curves[1] == curves[0] and curves[2] == curves[0]


# --- in process --------------------------------------------------------------------------------


def _indices(loader: DistributedBatchLoader) -> list[int]:
    """The samples of this rank's next step (the tokens are 0, 1, 2, ...: a window's first token
    tells its sample)."""
    inputs = torch.cat([batch[0] for batch in loader.next_batch()])
    return (inputs[:, 0] // inputs.shape[1]).tolist()


LIGHTHOUSE_STEPS = 16


def _free_port() -> int:
    """A port nothing listens on now: the lighthouse is started on it twice (killed, then
    restarted on the same address, as an operator would)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_a_lighthouse_killed_and_restarted_ends_no_group_and_loses_no_step(tmp_path):
    """The review's outage: `distrain lighthouse` SIGKILLed while two groups train and started
    again on its address 5 s later. torchft's manager servers lose the quorum requests the dead
    lighthouse held; the groups ask again every quorum_timeout_s / QUORUM_ATTEMPTS, the new
    lighthouse answers, and both groups finish every step once, each loss the 1-process run's
    (within FOUR_REL: the membership may change while the lighthouse is away)."""
    fields = {**GROUP_FIELDS, "training__steps": LIGHTHOUSE_STEPS, "checkpoint__at_end": False}
    fields |= {"fault_tolerance__quorum_timeout_s": 40, "debug__slow_ms": 300}
    reference = tmp_path / "reference"
    train_in_process(reference, **{**FIELDS, "training__steps": LIGHTHOUSE_STEPS})
    address = f"127.0.0.1:{_free_port()}"

    def lighthouse() -> subprocess.Popen:
        command = [sys.executable, "-m", "distrain", "lighthouse", "--bind", address]
        return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    server = lighthouse()
    runs = [tmp_path / f"group{g}" for g in range(2)]
    procs = [
        start_train(
            runs[g],
            "--nproc",
            "1",
            **fields,
            fault_tolerance__group=g,
            fault_tolerance__lighthouse=f"http://{address}",
        )
        for g in range(2)
    ]
    try:
        _wait(lambda: min(trained_step(r) for r in runs) >= 4, "step 4 in both groups", procs)
        server.kill()  # SIGKILL
        server.wait()
        time.sleep(5)
        server = lighthouse()
        outputs = [proc.communicate(timeout=400) for proc in procs]
    finally:
        for proc in (*procs, server):
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    for proc, (_, err) in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, err[-3000:]
    assert "asking again" in outputs[0][1] + outputs[1][1]
    want = losses(read_metrics(reference / "metrics.jsonl"))
    got = losses(read_metrics(runs[0] / "metrics.jsonl", all_attempts=True))
    assert sorted(got) == list(range(1, LIGHTHOUSE_STEPS + 1))
    rows = read_metrics(runs[0] / "metrics.jsonl", all_attempts=True)
    assert all(r.get("steps_lost", 0) == 0 for r in rows)
    for step, loss in got.items():
        assert abs(loss - want[step]) <= FOUR_REL * abs(want[step]), (step, loss, want[step])


def test_replan_gives_the_survivors_exactly_the_global_batch():
    tokens = np.arange(65 * 40, dtype=np.int64)
    dataset = TokenDataset(tokens, [(0, len(tokens))], seq_len=64)

    def loader(dp_rank: int, dp_size: int) -> DistributedBatchLoader:
        return DistributedBatchLoader(
            dataset, global_batch_size=8, micro_batch_size=2, dp_rank=dp_rank, dp_size=4, seed=1
        )

    # 2 groups x 2 ranks: the four slices are the global batch.
    full = sorted(i for r in range(4) for i in _indices(loader(r, 4)))
    assert len(full) == 8
    # Group 1 lost: without re-planning, group 0's ranks read only their half of it.
    assert sorted(i for r in range(2) for i in _indices(loader(r, 4))) != full
    survivors = []
    for rank in range(2):
        replanned = loader(rank, 4)
        replanned.replan(dp_rank=rank, dp_size=2)
        assert replanned.accum_steps == 2
        survivors += _indices(replanned)
    assert sorted(survivors) == full


@pytest.mark.compat
def test_one_replica_group_is_refused_in_one_line(tmp_path):
    fields = {"run.dir": str(tmp_path), "fault_tolerance.replica_groups": "1"}
    with pytest.raises(ConfigError) as error:
        load_config(None, list(fields.items()))
    message = str(error.value)
    assert "fault_tolerance.replica_groups = 1 is out of range: it must be 0 or >= 2" in message
    assert "\n" not in message


@pytest.mark.compat
@pytest.mark.parametrize(
    ("option", "value"),
    [("--heartbeat-timeout-ms", "0"), ("--join-timeout-s", "0"), ("--tick-ms", "-5")],
)
def test_lighthouse_refuses_a_timeout_it_cannot_use_in_one_line(option, value, capsys):
    from distrain.cli import main

    assert main(["lighthouse", option, value]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"distrain: error: {option} must be") and err.count("\n") == 1, err
