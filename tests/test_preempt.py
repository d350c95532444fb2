"""Preemption: a stop signal (SIGTERM, SIGUSR1, SIGINT) from outside, to the launcher, to one
worker or to every process at once, makes the run finish its step, commit a `preempt`
checkpoint and exit 75; the next start resumes from it bit for bit. A second signal aborts
without harming earlier checkpoints; a save that outlives the grace period is cut off.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from batch import Run, pool_name
from helpers import SMALL_RUN, losses, overrides, start_train, train_cli, train_in_process

from distrain.checkpoint.checkpointer import Checkpointer
from distrain.checkpoint.manifest import committed, verify
from distrain.checkpoint.storage import Storage
from distrain.config.io import load_config
from distrain.errors import ConfigError
from distrain.launch.preempt import (
    DUPLICATE_WINDOW_S,
    EXIT_PREEMPTED,
    Preempted,
    StopAgreement,
    StopSignals,
    launcher_outcome,
)
from distrain.launch.torchrun import make_plan, torchrun_argv
from distrain.observe.metrics import read_metrics

STEPS = 20
# Enough steps after the signal that a loaded CI machine still stops mid-run (a step takes
# ~0.3 s here); a checkpoint every 2 steps gives the abort test an earlier one to keep.
FIELDS = {
    "training__steps": STEPS,
    **SMALL_RUN,
    "checkpoint__interval_steps": 0,
    "checkpoint__at_end": False,
}
SIGNAL_AFTER_STEP = 2
EXIT_TIMEOUT_S = 120


def wait_for_step(proc: subprocess.Popen, run: Path, step: int) -> None:
    """Block until the run logged `step` (the workers are in the loop), or fail."""
    metrics = run / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[1][-4000:]
        if metrics.exists() and any(
            r.get("step", 0) >= step for r in read_metrics(metrics) if "loss" in r
        ):
            return
        time.sleep(0.05)
    raise AssertionError(f"step {step} not reached")


def worker_pids(launcher: int) -> list[int]:
    """The launcher's children: torchrun's agent runs in it and starts the workers directly."""
    children = Path(f"/proc/{launcher}/task/{launcher}/children").read_text().split()
    return sorted(int(pid) for pid in children)


def processes_of(run: Path) -> list[str]:
    """Command lines of live processes that name the run dir: none may outlive the launcher."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = (entry / "stat").read_text().split(") ")[-1][0]
        except OSError:
            continue
        if str(run) in cmdline and state != "Z":
            found.append(f"{entry.name}: {cmdline}")
    return found


def finish(proc: subprocess.Popen) -> tuple[int, str]:
    _, err = proc.communicate(timeout=EXIT_TIMEOUT_S)
    return proc.returncode, err


def assert_preempted(run: Path, rc: int, err: str) -> int:
    """rc 75, one line from the launcher and no traceback, a committed preempt checkpoint that
    every rank stopped at, no process left. Returns the checkpoint's step."""
    assert rc == EXIT_PREEMPTED, err[-4000:]
    assert "Traceback" not in err and "SignalException" not in err, err[-4000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("distrain: preempted: stopped by "), err[-4000:]
    # Said once, by the launcher; torchrun's agent adds no warning per signal and worker.
    assert err.count("preempt checkpoint step-") == 1, err[-4000:]
    assert "torch/distributed/elastic" not in err, err[-4000:]
    entries = committed(Storage(str(run / "checkpoints")))
    assert [e.kind for e in entries][-1:] == ["preempt"], entries
    step = entries[-1].step
    assert verify(Storage(str(run / "checkpoints")), entries[-1]) is None
    assert 0 < step < STEPS
    for rank in (0, 1):
        log = (run / "logs" / f"rank{rank}.log").read_text()
        assert f"after step {step} of {STEPS}" in log, log[-2000:]
    assert processes_of(run) == []
    return step


REFERENCE = "reference"


def batched_runs(names: set[str]) -> dict[str, Run]:
    """The uninterrupted 2-rank run, where the resume test is selected (tests/batch.py's pool:
    it shares the session's 2-rank torchrun launch)."""
    user = "test_sigterm_to_launcher_saves_and_the_next_start_resumes_bit_exact"
    return {REFERENCE: Run(2, FIELDS)} if any(n.startswith(user) for n in names) else {}


@pytest.fixture(scope="module")
def reference(batch_pool) -> dict[int, float]:
    """An uninterrupted 2-rank run's losses."""
    run_dir = batch_pool.trained(pool_name(__name__, REFERENCE))
    return losses(read_metrics(run_dir / "metrics.jsonl"))


# Background saves at every step: the stop signal's save waits for the one in flight, then
# commits its own.
BACKGROUND = {"checkpoint__async_mode": "thread", "checkpoint__interval_steps": 1}


@pytest.mark.slow
@pytest.mark.parametrize("saves", [{}, BACKGROUND], ids=["sync", "background"])
def test_sigterm_to_launcher_saves_and_the_next_start_resumes_bit_exact(tmp_path, reference, saves):
    run = tmp_path / "run"
    proc = start_train(run, "--nproc", "2", **{**FIELDS, **saves})
    wait_for_step(proc, run, SIGNAL_AFTER_STEP)
    sent = time.monotonic()
    os.kill(proc.pid, signal.SIGTERM)
    rc, err = finish(proc)
    took = time.monotonic() - sent
    step = assert_preempted(run, rc, err)
    assert "stopped by SIGTERM" in err
    assert took < 120 + 5, took  # the default grace period plus the agent's margin

    if saves:
        kinds = {e.step: e.kind for e in committed(Storage(str(run / "checkpoints")))}
        assert kinds[step] == "preempt" and kinds.get(step - 1) == "temporary", kinds
    resumed = train_cli(run, 2, **FIELDS)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert f"resumed from checkpoint step-{step:08d}" in (run / "logs" / "rank0.log").read_text()
    # fp32 on CPU, same 2 ranks, restored RNG and loader position: the same floats.
    assert losses(read_metrics(run / "metrics.jsonl")) == reference


@pytest.mark.slow
def test_sigusr1_to_one_worker_stops_every_rank_at_the_same_step(tmp_path):
    run = tmp_path / "run"
    proc = start_train(run, "--nproc", "2", **FIELDS)
    wait_for_step(proc, run, SIGNAL_AFTER_STEP)
    workers = worker_pids(proc.pid)
    assert len(workers) == 2, workers
    os.kill(workers[1], signal.SIGUSR1)
    rc, err = finish(proc)
    assert_preempted(run, rc, err)
    logs = [(run / "logs" / f"rank{r}.log").read_text() for r in (0, 1)]
    assert "SIGUSR1: finishing this step" in logs[0] + logs[1]
    # Only one worker saw the signal; the other learned it through the agreement.
    assert "a stop signal on another rank" in logs[0] + logs[1]


@pytest.mark.slow
def test_sigterm_to_every_process_at_once_is_one_request(tmp_path):
    """As Slurm does: the launcher and each worker get SIGTERM, and the agent forwards its own
    copy. The duplicates must not count as a second (aborting) signal."""
    run = tmp_path / "run"
    proc = start_train(run, "--nproc", "2", **FIELDS)
    wait_for_step(proc, run, SIGNAL_AFTER_STEP)
    for pid in [proc.pid, *worker_pids(proc.pid)]:
        os.kill(pid, signal.SIGTERM)
    rc, err = finish(proc)
    assert_preempted(run, rc, err)
    assert "aborting" not in err


@pytest.mark.slow
def test_more_sigterms_after_the_commit_keep_the_preempted_outcome(tmp_path):
    """Slurm, or an impatient user, sends SIGTERM again once the launcher has said its preempt
    checkpoint is committed: it still exits 75, not 143 (a death by that signal after saying
    "committed")."""
    run = tmp_path / "run"
    proc = start_train(run, "--nproc", "2", **FIELDS)
    wait_for_step(proc, run, SIGNAL_AFTER_STEP)
    os.kill(proc.pid, signal.SIGTERM)
    said = []
    for line in proc.stderr:
        said.append(line)
        if line.startswith("distrain: preempted:"):
            break
    for _ in range(2):
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGTERM)
    rc, rest = finish(proc)
    assert_preempted(run, rc, "".join(said) + rest)


@pytest.mark.slow
def test_second_sigint_during_the_save_aborts_and_keeps_earlier_checkpoints(tmp_path):
    run = tmp_path / "run"
    fields = dict(
        FIELDS,
        checkpoint__interval_steps=2,
        checkpoint__async_mode="thread",
        debug__preempt_delay_s=60,
    )
    proc = start_train(run, "--nproc", "2", **fields)
    wait_for_step(proc, run, SIGNAL_AFTER_STEP + 1)
    storage = Storage(str(run / "checkpoints"))
    first = time.monotonic()
    os.kill(proc.pid, signal.SIGINT)  # what Ctrl-C sends the launcher (workers have own session)
    logs = run / "logs" / "rank0.log"
    deadline = time.monotonic() + 120
    while "debug.preempt_delay_s" not in logs.read_text():
        assert time.monotonic() < deadline and proc.poll() is None, logs.read_text()[-2000:]
        time.sleep(0.05)
    before = [e.step for e in committed(storage)]
    time.sleep(max(0.0, first + DUPLICATE_WINDOW_S + 0.5 - time.monotonic()))
    os.kill(proc.pid, signal.SIGINT)  # a second Ctrl-C, not a copy of the first
    rc, err = finish(proc)

    assert rc == 128 + signal.SIGINT, err[-4000:]
    assert "Traceback" not in err, err[-4000:]
    assert "before a preempt checkpoint was committed" in err.strip().splitlines()[-1]
    # The agent passes the second signal on as SIGTERM.
    assert "second stop signal (SIGTERM): aborting" in logs.read_text()
    assert processes_of(run) == []
    # The interrupted save left its shards but no manifest; every earlier one still verifies.
    entries = committed(storage)
    assert before and [e.step for e in entries] == before
    assert all(verify(storage, e) is None for e in entries)
    torn = {int(n.removeprefix("step-")) for n in storage.listdir() if n.startswith("step-")}
    torn -= set(before)
    assert len(torn) == 1 and min(torn) > max(before), (torn, before)


@pytest.mark.slow
def test_a_save_longer_than_the_grace_period_is_cut_off(tmp_path):
    """One process, no launcher: the worker's own timer bounds the stop."""
    run = tmp_path / "run"
    args = [sys.executable, "-m", "distrain.train"]
    fields = dict(FIELDS, checkpoint__preempt_grace_s=2, checkpoint__async_mode="thread")
    for key, value in overrides(run, **fields, debug__preempt_delay_s=60):
        args += [f"--{key}", value]
    proc = subprocess.Popen(args, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    wait_for_step(proc, run, SIGNAL_AFTER_STEP)
    sent = time.monotonic()
    os.kill(proc.pid, signal.SIGTERM)
    rc, _ = finish(proc)
    assert rc == 128 + signal.SIGTERM
    assert time.monotonic() - sent < 30  # 2 s of grace plus one step, far below the 60 s delay
    log = (run / "logs" / "rank0.log").read_text()
    assert "checkpoint.preempt_grace_s (2s) spent" in log
    assert all(e.kind != "preempt" for e in committed(Storage(str(run / "checkpoints"))))


def test_sigint_in_process_stops_with_a_preempt_checkpoint(tmp_path):
    """One rank in this process; the signal comes from another thread mid-run."""
    run = tmp_path / "run"
    metrics = run / "metrics.jsonl"

    def send_when_running() -> None:
        while not (metrics.exists() and metrics.read_text().count("\n") >= 1):
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGINT)

    sender = threading.Thread(target=send_when_running, daemon=True)
    sender.start()
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(Preempted, match=r"stopped by SIGINT after step \d+ of 20"):
        train_in_process(run, **FIELDS)
    sender.join()
    assert signal.getsignal(signal.SIGINT) is before  # handlers restored for the next user
    entries = committed(Storage(str(run / "checkpoints")))
    assert [e.kind for e in entries] == ["preempt"]
    # One rank needs no agreement: it stops after the step during which the signal came.
    assert entries[-1].step == max(losses(read_metrics(metrics)))


# --- pieces, in process ------------------------------------------------------------------------


class _Signals:
    def __init__(self) -> None:
        self.requested = 0


def test_agreement_on_one_rank_is_immediate():
    signals = _Signals()
    agreement = StopAgreement(signals, None)  # type: ignore[arg-type]
    assert agreement.stop_now() is False
    signals.requested = signal.SIGTERM
    assert agreement.stop_now() is True
    assert agreement.signal_name == "SIGTERM"


def test_duplicate_signals_are_one_request_and_handlers_are_restored(tmp_path):
    import logging

    before = signal.getsignal(signal.SIGTERM)
    signals = StopSignals(grace_s=60, logger=logging.getLogger("test_preempt"))
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGUSR1)  # within the duplicate window: not an abort
        assert signals.requested == signal.SIGTERM
    finally:
        signals.close()
    assert signal.getsignal(signal.SIGTERM) is before
    assert signals.timer is not None and not signals.timer.is_alive()


def _commit(storage: Storage, step: int, kind: str, when: float) -> None:
    path = storage.path(f"step-{step:08d}")
    storage.makedirs(path)
    (Path(path) / "x").write_text("x")
    manifest = {"step": step, "kind": kind, "time": when, "files": {}}
    (Path(path) / "MANIFEST.json").write_text(json.dumps(manifest))


def test_launcher_outcome_names_the_checkpoint_or_the_failure(tmp_path):
    storage = Storage(str(tmp_path))
    error = launcher_outcome(storage, since=0.0, signum=signal.SIGTERM)
    assert not isinstance(error, Preempted) and error.exit_code == 128 + signal.SIGTERM
    assert "no checkpoint" in str(error)
    _commit(storage, 4, "temporary", time.time())
    _commit(storage, 6, "preempt", 100.0)
    stale = launcher_outcome(storage, since=200.0, signum=signal.SIGUSR1)
    assert not isinstance(stale, Preempted) and "newest checkpoint is step-00000006" in str(stale)
    fresh = launcher_outcome(storage, since=50.0, signum=None)
    assert isinstance(fresh, Preempted) and fresh.exit_code == EXIT_PREEMPTED
    assert "step-00000006" in str(fresh)


def test_retention_keeps_the_newest_preempt_checkpoint(tmp_path):
    import logging

    storage = Storage(str(tmp_path))
    ckpt = Checkpointer(
        storage,
        run_id="test",
        layout="",
        async_mode="off",
        keep_temporary=1,
        logger=logging.getLogger("t"),
    )
    ckpt.save(2, {"x": torch.zeros(2)}, permanent=False)
    ckpt.save(3, {"x": torch.zeros(2)}, permanent=False, preempt=True)
    # The preempt one is what resumes next: not counted among the temporary ones while newest.
    assert [(e.step, e.kind) for e in committed(storage)] == [(2, "temporary"), (3, "preempt")]
    ckpt.save(5, {"x": torch.zeros(2)}, permanent=False)
    # Superseded, it counts as temporary.
    assert [e.step for e in committed(storage)] == [5]
    ckpt.save(6, {"x": torch.zeros(2)}, permanent=True)
    assert [e.step for e in committed(storage)] == [5, 6]


def test_a_preempt_save_at_a_permanent_step_is_kept_like_a_permanent_one(tmp_path):
    import logging

    storage = Storage(str(tmp_path))
    ckpt = Checkpointer(
        storage,
        run_id="test",
        layout="",
        async_mode="off",
        keep_temporary=1,
        logger=logging.getLogger("t"),
    )
    ckpt.save(3, {"x": torch.zeros(2)}, permanent=True, preempt=True)
    ckpt.save(5, {"x": torch.ones(2)}, permanent=False)
    ckpt.save(7, {"x": torch.ones(2)}, permanent=False)
    # The stop came at a step a permanent checkpoint was due: superseded, it is still kept.
    assert [(e.step, e.kind, e.permanent) for e in committed(storage)] == [
        (3, "preempt", True),
        (7, "temporary", False),
    ]


def test_launch_asks_the_agent_to_forward_sigusr1_and_wait_the_grace_period():
    plan = make_plan(
        2,
        nnodes=None,
        node_rank=None,
        rdzv_endpoint=None,
        rdzv_id=None,
        max_restarts=0,
        grace_s=30,
    )
    argv = torchrun_argv(plan, [])
    handled = next(a for a in argv if a.startswith("--signals-to-handle="))
    assert {"SIGTERM", "SIGUSR1", "SIGINT"} <= set(handled.split("=")[1].split(","))
    assert "--shutdown-timeout=35" in argv


def test_grace_period_must_be_positive(tmp_path):
    with pytest.raises(
        ConfigError, match=r"checkpoint.preempt_grace_s = 0 is out of range: it must be >= 1"
    ):
        load_config(None, [("checkpoint.preempt_grace_s", "0")])
