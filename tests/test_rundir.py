"""One run per run dir, failed starts that leave no trace, metrics that read as one curve,
workers that die with their launcher, clean output through a pipe, and the one teardown of
process groups (parallel/device.py's teardown)."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import pytest
from helpers import (
    cli_in_process,
    losses,
    overrides,
    process_group,
    run_cli,
    start_train,
    train_in_process,
)

import distrain.launch.torchrun
from distrain.checkpoint.storage import Storage
from distrain.errors import CheckpointError, ConfigError
from distrain.launch.lifeline import LAUNCHER_PID_ENV
from distrain.launch.rundir import (
    HELD_BY_LAUNCHER_ENV,
    LOCK_NAME,
    LockHolder,
    RunDirBusy,
    RunDirLock,
)
from distrain.launch.torchrun import (
    launch,
    make_plan,
    torchrun_argv,
    worker_env,
    worker_threads,
)
from distrain.observe.logs import close_logging, setup_logging
from distrain.observe.metrics import MetricsWriter, read_metrics
from distrain.observe.progress import Progress
from distrain.train.fault_injection import InjectedFailure

TINY = {
    "training__steps": 4,
    "training__global_batch_size": 4,
    "training__micro_batch_size": 4,
    "training__seq_len": 32,
    "data__max_bytes": 300_000,
    "checkpoint__interval_steps": 0,
    "checkpoint__at_end": False,
}

TWO_RANKS = dict(TINY, training__micro_batch_size=2)


def _write_holder(run_dir: Path, **fields: object) -> None:
    """A lock of this process (its host, boot and pid namespace), changed by `fields`."""
    holder = asdict(LockHolder.me())
    holder.update(start_ticks=None, job="", since="then")
    holder.update(fields)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / LOCK_NAME).write_text(json.dumps(holder))


# ------------------------------------------------------------------------------------ the lock


def test_second_lock_is_refused_naming_the_holder(tmp_path):
    with RunDirLock(tmp_path / "run"):
        with pytest.raises(RunDirBusy) as busy:
            RunDirLock(tmp_path / "run").acquire()
    message = str(busy.value)
    assert f"host {socket.gethostname()} pid {os.getpid()}" in message
    assert "choose another --run-dir" in message
    assert not (tmp_path / "run" / LOCK_NAME).exists()  # released on exit
    assert not (tmp_path / "run").exists()  # and the dir the lock created is gone with it


def test_stale_lock_of_a_dead_or_recycled_pid_is_taken_over(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    _write_holder(tmp_path, pid=dead.pid)
    with RunDirLock(tmp_path) as lock:
        assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
        assert lock.held
    # A live pid with another start time is another process that reuses the holder's pid.
    me = LockHolder.me()
    _write_holder(tmp_path, start_ticks=me.start_ticks + 1)
    with RunDirLock(tmp_path):
        assert json.loads((tmp_path / LOCK_NAME).read_text())["start_ticks"] == me.start_ticks


def test_lock_of_another_host_is_refused_with_the_file_to_delete(tmp_path):
    _write_holder(tmp_path, host="node-7", pid=1234)
    with pytest.raises(RunDirBusy, match="host node-7 pid 1234") as busy:
        RunDirLock(tmp_path).acquire()
    assert f"delete {tmp_path / LOCK_NAME}" in str(busy.value)
    assert json.loads((tmp_path / LOCK_NAME).read_text())["host"] == "node-7"  # untouched


def test_lock_of_an_earlier_attempt_of_this_elastic_job_is_taken_over(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-42")
    _write_holder(tmp_path, host="node-7", pid=1234, job="job-42")
    with RunDirLock(tmp_path):
        assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    # torchrun's default id is shared by unrelated jobs: it proves nothing.
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    _write_holder(tmp_path, host="node-7", pid=1234, job="")
    with pytest.raises(RunDirBusy):
        RunDirLock(tmp_path).acquire()


def test_workers_keep_torchfts_rust_log_quiet_unless_asked(monkeypatch):
    """torchft's Rust side logs each quorum at INFO: the workers get RUST_LOG=warn by default,
    and the user's own RUST_LOG when set."""
    from distrain.launch.torchrun import worker_env

    plan = make_plan(
        1, nnodes=None, node_rank=None, rdzv_endpoint=None, rdzv_id=None, max_restarts=0
    )
    monkeypatch.delenv("RUST_LOG", raising=False)
    assert worker_env(plan)["RUST_LOG"] == "warn"
    monkeypatch.setenv("RUST_LOG", "info")
    assert worker_env(plan)["RUST_LOG"] == "info"


def test_unrelated_runs_with_default_rendezvous_ids_do_not_take_each_others_lock(
    tmp_path, monkeypatch
):
    """Elastic launches without --rdzv-id: each run's rank 0 takes the lock, named by its
    torchelastic run id (the rendezvous id). A shared default made the second run's rank 0
    take the first, live run's lock for its own earlier attempt's."""
    plans = [
        make_plan(
            1,
            nnodes=None,
            node_rank=None,
            rdzv_endpoint="localhost:1",
            rdzv_id=None,
            max_restarts=0,
        )
        for _ in range(2)
    ]
    assert plans[0].rdzv_id != plans[1].rdzv_id
    assert f"--rdzv-id={plans[1].rdzv_id}" in torchrun_argv(plans[1], [])
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", plans[0].rdzv_id)
    with RunDirLock(tmp_path / "run"):
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", plans[1].rdzv_id)
        with pytest.raises(RunDirBusy, match="is in use by another run"):
            RunDirLock(tmp_path / "run").acquire()
        # A later attempt of the first run (its id, given by the agent) is the same job.
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", plans[0].rdzv_id)
        with RunDirLock(tmp_path / "run"):
            pass
    # The nodes of one job share an id: several nodes need it given.
    two = dict(nnodes="2", node_rank=None, rdzv_endpoint="node0:29400", max_restarts=0)
    assert make_plan(1, **two, rdzv_id="job-7").rdzv_id == "job-7"
    with pytest.raises(
        ConfigError, match="^--nnodes 2 lets other nodes join: give every node the same --rdzv-id"
    ):
        make_plan(1, **two, rdzv_id=None)


def test_a_requeued_slurm_job_takes_over_its_own_lock_from_another_node(tmp_path, monkeypatch):
    """A hard-killed Slurm job leaves node 0's launcher lock behind; its requeued start (same
    SLURM_JOB_ID, the next SLURM_RESTART_COUNT) may land on another first node."""
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    _write_holder(tmp_path, host="node-7", pid=1234, slurm_job="4242", slurm_start=0)
    with RunDirLock(tmp_path):
        mine = json.loads((tmp_path / LOCK_NAME).read_text())
        assert (mine["host"], mine["slurm_job"], mine["slurm_start"]) == (
            socket.gethostname(),
            "4242",
            1,
        )
    # Another job's lock, or one of this same start (a second srun step), is a live run's.
    for other in ({"slurm_job": "4243", "slurm_start": 0}, {"slurm_job": "4242", "slurm_start": 1}):
        _write_holder(tmp_path, host="node-7", pid=1234, **other)
        with pytest.raises(RunDirBusy, match="host node-7 pid 1234"):
            RunDirLock(tmp_path).acquire()


def test_a_holder_in_another_pid_namespace_is_not_judged_by_its_pid(tmp_path):
    """Containers with host networking share the host name, not pids: a pid that is not alive
    here may be a live run there. So may a pid of another boot of a host of the same name."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    me = LockHolder.me()
    for other in ({"pid_ns": me.pid_ns + 1}, {"boot_id": "another-boot"}):
        _write_holder(tmp_path, pid=dead.pid, **other)
        with pytest.raises(RunDirBusy) as busy:
            RunDirLock(tmp_path).acquire()
        assert f"pid {dead.pid}" in str(busy.value)
        assert "in another pid namespace or boot" in str(busy.value)
        assert f"delete {tmp_path / LOCK_NAME}" in str(busy.value)
        assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == dead.pid  # untouched
    # In this pid namespace and boot the pid decides, as before.
    _write_holder(tmp_path, pid=dead.pid)
    with RunDirLock(tmp_path):
        assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()


def test_distrain_train_refuses_a_run_dir_in_use(tmp_path):
    run = tmp_path / "run"
    with RunDirLock(run):  # this test process plays the other run
        result = run_cli("train", "--nproc", "1", "--run-dir", str(run))
    assert result.returncode == 1
    errors = [line for line in result.stderr.splitlines() if line.startswith("distrain: error:")]
    assert len(errors) == 1
    assert errors[0].startswith(
        f"distrain: error: run dir {run} is in use by another run: "
        f"host {socket.gethostname()} pid {os.getpid()} (since "
    )
    assert errors[0].endswith("wait for it to finish or choose another --run-dir")
    assert "Traceback" not in result.stderr


def test_worker_rank0_takes_the_lock_without_a_launcher(tmp_path):
    run = tmp_path / "run"
    with RunDirLock(run):
        with pytest.raises(RunDirBusy, match=f"pid {os.getpid()}"):
            train_in_process(run, **TINY)
        assert sorted(p.name for p in run.iterdir()) == [LOCK_NAME]  # the busy start wrote nothing


# ----------------------------------------------------------------------- failed starts, metrics


def test_resume_without_a_checkpoint_is_refused_before_launch(tmp_path, capsys):
    run = tmp_path / "run"
    refused = cli_in_process(capsys, "train", "--resume", "--run.dir", str(run))
    assert refused.returncode != 0 and not run.exists()
    assert refused.stderr.strip().splitlines() == [
        f"distrain: error: --resume: no complete checkpoint under {run / 'checkpoints'}; drop "
        "--resume to start a new run"
    ]


def test_failed_resume_removes_only_what_it_created(tmp_path):
    fresh = tmp_path / "fresh"
    with pytest.raises(CheckpointError, match="--resume: no complete checkpoint"):
        train_in_process(fresh, **TINY, run__resume=True, metrics__tensorboard=True)
    assert not fresh.exists()

    kept = tmp_path / "kept"
    (kept / "logs").mkdir(parents=True)
    (kept / "notes.txt").write_text("mine")
    (kept / "logs" / "old.log").write_text("an earlier run's")
    with pytest.raises(CheckpointError):
        train_in_process(kept, **TINY, run__resume=True, metrics__tensorboard=True)
    assert sorted(str(p.relative_to(kept)) for p in kept.rglob("*")) == [
        "logs",
        "logs/old.log",
        "notes.txt",
    ]


def test_unexpected_error_goes_to_the_rank_log(tmp_path):
    run = tmp_path / "run"
    with pytest.raises(InjectedFailure):
        train_in_process(run, **TINY, debug__fail_at_step=2)
    log = (run / "logs" / "rank0.log").read_text()
    assert "unexpected error, traceback follows" in log
    assert "Traceback (most recent call last)" in log
    assert "InjectedFailure: debug.fail_at_step: rank 0 crashes at step 2" in log
    assert (run / "config.toml").exists()  # a crash after the start keeps the run dir


def test_resumed_run_reads_as_one_curve(tmp_path):
    fields = dict(TINY, training__steps=6, checkpoint__interval_steps=2)
    full = losses(train_in_process(tmp_path / "full", **fields))
    run = tmp_path / "run"
    with pytest.raises(InjectedFailure):
        train_in_process(run, **fields, debug__fail_at_step=4)  # logs step 3, checkpoint at 2
    rows = train_in_process(run, **fields)
    raw = read_metrics(run / "metrics.jsonl", all_attempts=True)
    assert [r["step"] for r in raw if "loss" in r] == [1, 2, 3, 3, 4, 5, 6]
    assert [r.get("attempt", 0) for r in raw if "loss" in r] == [0, 0, 0, 1, 1, 1, 1]
    assert {"step": 2, "resumed_from": 2, "attempt": 1} in raw
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4, 5, 6]  # one curve
    assert losses(rows) == full


def test_metrics_writer_cuts_a_torn_line_and_counts_attempts(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(
        '{"step": 1, "loss": 2.0, "attempt": 0}\n{"step": 2, "lo'
    )
    assert read_metrics(tmp_path / "metrics.jsonl") == [{"step": 1, "loss": 2.0, "attempt": 0}]
    writer = MetricsWriter(tmp_path, enabled=True, tensorboard=False)
    writer.start(0)  # a restart without a checkpoint: from scratch
    writer.log({"step": 1, "loss": 1.5})
    writer.close()
    assert read_metrics(tmp_path / "metrics.jsonl") == [
        {"step": 0, "resumed_from": 0, "attempt": 1},
        {"step": 1, "loss": 1.5, "attempt": 1},
    ]


# -------------------------------------------------------------------------------------- output


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _drive(progress: Progress, logger: logging.Logger, steps: int) -> None:
    for step in range(1, steps + 1):
        progress.update(1)
        progress.set_postfix(loss=f"{1 / step:.4f}")
        if step % 25 == 0:
            logger.info("step %d: val_loss 1.0", step)
    progress.close()


def test_progress_through_a_pipe_is_a_few_plain_lines(tmp_path, capsys):
    logger = setup_logging(tmp_path, 0)
    _drive(Progress(total=600, initial=0, enabled=True, logger=logger), logger, 600)
    close_logging(logger)
    lines = capsys.readouterr().err.splitlines()
    progress = [line for line in lines if line.startswith("[distrain] train: ")]
    assert [line.split()[2] for line in progress] == [f"{p}%" for p in range(10, 101, 10)]
    assert "600/600 steps, loss 0.0017" in progress[-1]
    assert len(lines) == len(progress) + 600 // 25  # nothing else: no bar redraws
    assert all(line.startswith("[distrain] ") for line in lines)
    assert "\r" not in "".join(lines) and "\x1b" not in "".join(lines)


def test_log_lines_on_a_terminal_are_written_around_the_bar(tmp_path, monkeypatch):
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    logger = setup_logging(tmp_path, 0)
    _drive(Progress(total=100, initial=0, enabled=True, logger=logger), logger, 100)
    close_logging(logger)
    out = terminal.getvalue()
    assert out.count("[distrain] step ") == 4
    # tqdm clears the bar line ("\r" + blanks + "\r") before a log line: never glued to a bar.
    for chunk in out.split("[distrain] step ")[1:]:
        assert chunk.split("\n", 1)[0].endswith("val_loss 1.0")
    for chunk in out.split("[distrain] step ")[:-1]:
        assert chunk.endswith("\r") or chunk.endswith("\n")
    assert "100/100" in out


# ------------------------------------------------------------------- processes (torchrun, slow)


@pytest.mark.slow
def test_workers_import_the_launchers_package_and_output_is_clean(tmp_path, check_ok):
    """From a folder holding another `distrain` package, as the parent of a clone does; the
    launcher itself runs as the `distrain` console script would (safe path, -P)."""
    cwd = tmp_path / "cwd"
    (cwd / "distrain").mkdir(parents=True)
    (cwd / "distrain" / "__init__.py").write_text("raise ImportError('the folder in the cwd')\n")
    run = tmp_path / "run"
    args = [sys.executable, "-P", "-m", "distrain", "train", "--nproc", "2"]
    for key, value in overrides(
        run, **dict(TWO_RANKS, training__steps=20, metrics__progress_bar=True)
    ):
        args += [f"--{key}", value]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("OMP_NUM_THREADS", None)
    result = check_ok(
        subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=240, env=env)
    )
    cores = len(os.sched_getaffinity(0))
    threads = max(1, cores // 2)
    said = f"[distrain] {threads} CPU thread(s) per worker ({cores} cores / 2 workers)"
    assert result.stderr.count(said) == 1
    assert "OMP_NUM_THREADS environment variable" not in result.stderr  # torchrun's banner
    assert f"{threads} CPU thread(s)" in (run / "logs" / "rank0.log").read_text()
    progress = [line for line in result.stderr.splitlines() if " train: " in line]
    assert len(progress) == 10 and progress[-1].startswith("[distrain] train: 100% 20/20")
    assert "\r" not in result.stderr


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.slow
def test_workers_die_when_the_launcher_is_killed(tmp_path):
    run = tmp_path / "run"
    launcher = start_train(run, "--nproc", "2", **dict(TWO_RANKS, training__steps=100_000))
    try:
        deadline = time.monotonic() + 180
        while not (run / "metrics.jsonl").exists() or not (run / "metrics.jsonl").read_text():
            assert launcher.poll() is None and time.monotonic() < deadline
            time.sleep(0.5)
        workers = [p for p in _children(launcher.pid) if "distrain.train" in _cmdline(p)]
        assert len(workers) == 2
        os.kill(launcher.pid, signal.SIGKILL)  # from outside, as a user or a scheduler would
        launcher.wait()
        deadline = time.monotonic() + 30
        while any(_alive(p) for p in workers) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_alive(p) for p in workers)
        assert (run / LOCK_NAME).exists()  # the killed launcher's lock, stale now: taken over
        with RunDirLock(run):
            pass
    finally:
        if launcher.poll() is None:
            launcher.kill()


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
    except OSError:
        return ""


def test_parent_watch_kills_an_orphan(tmp_path):
    """The fallback where prctl is missing: a grandchild whose parent dies exits by itself."""
    code = (
        "import os, subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', "
        "'import os, time; from distrain.launch.lifeline import watch_parent; "
        "watch_parent(os.getppid(), 0.1); time.sleep(60)'])\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    middle = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    grandchild = int(middle.stdout.readline())
    time.sleep(3)  # the grandchild imports distrain and starts watching
    assert _alive(grandchild)
    middle.kill()
    middle.wait()
    deadline = time.monotonic() + 20
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(grandchild)


@pytest.mark.parametrize("fails", [False, True])
def test_launch_sets_the_workers_environment_only_while_the_agent_runs(
    tmp_path, monkeypatch, fails
):
    """A torchrun started later from this process (a second training in one script, a notebook)
    must not pass DISTRAIN_LAUNCHER_PID to its workers: they would SIGKILL themselves."""
    seen = {}

    def agent(_args) -> None:  # torchrun's agent, which copies os.environ into the workers'
        seen.update(os.environ)
        if fails:
            raise RuntimeError("the agent failed")

    monkeypatch.setattr(distrain.launch.torchrun, "run", agent)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    monkeypatch.delenv(LAUNCHER_PID_ENV, raising=False)
    before = dict(os.environ)
    plan = make_plan(
        1, nnodes=None, node_rank=None, rdzv_endpoint=None, rdzv_id=None, max_restarts=0
    )
    with contextlib.suppress(RuntimeError):
        launch(plan, [], run_dir=str(tmp_path / "run"), checkpoints=Storage(str(tmp_path)))
    assert seen[LAUNCHER_PID_ENV] == str(os.getpid())
    assert seen[HELD_BY_LAUNCHER_ENV] == str(tmp_path / "run" / LOCK_NAME)
    assert seen["PYTHONSAFEPATH"] == "1"
    assert LAUNCHER_PID_ENV not in os.environ
    assert dict(os.environ) == before  # OMP_NUM_THREADS=3 and PYTHONPATH as they were
    assert not (tmp_path / "run" / LOCK_NAME).exists()


def test_worker_threads_respect_the_user_and_share_the_cores(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert worker_threads(8) == (3, "OMP_NUM_THREADS from the environment")
    monkeypatch.setenv("OMP_NUM_THREADS", "many")
    with pytest.raises(ConfigError, match="OMP_NUM_THREADS='many': expected a positive integer"):
        worker_threads(2)
    monkeypatch.delenv("OMP_NUM_THREADS")
    cores = len(os.sched_getaffinity(0))
    assert worker_threads(2) == (max(1, cores // 2), f"{cores} cores / 2 workers")
    assert worker_threads(10 * cores)[0] == 1


def test_replica_groups_on_one_host_share_its_cores(monkeypatch):
    """3 replica groups of 2 workers on one host (a loopback lighthouse): each worker gets
    cores // 6 threads, not cores // 2; groups that may be elsewhere count only their own
    workers; OMP_NUM_THREADS still wins."""
    import argparse

    from distrain.cli import _launch_plan
    from distrain.config.io import load_config
    from distrain.ft.network import groups_on_this_host

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(12)), raising=False)
    assert groups_on_this_host(3, "http://localhost:29510") == 3
    assert groups_on_this_host(3, "http://127.0.0.1:29510") == 3
    assert groups_on_this_host(3, "http://10.1.2.3:29510") == 1
    assert groups_on_this_host(0, "http://localhost:29510") == 1
    assert groups_on_this_host(3, "") == 1
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://[::1]:29510")
    assert groups_on_this_host(3, "") == 3
    ns = argparse.Namespace(
        nproc=2, nnodes=None, node_rank=None, rdzv_endpoint=None, rdzv_id=None, max_restarts=None
    )
    cfg = load_config(
        None,
        [("fault_tolerance.replica_groups", "3"), ("fault_tolerance.lighthouse", "localhost:1")],
    )
    plan = _launch_plan(ns, cfg.run.device, cfg.checkpoint.preempt_grace_s, cfg.fault_tolerance)
    assert plan.local_groups == 3
    assert worker_threads(plan.nproc, plan.local_groups) == (
        2,
        "12 cores / 6 workers of 3 replica groups on this host",
    )
    assert worker_env(plan)["OMP_NUM_THREADS"] == "2"
    assert worker_threads(2) == (6, "12 cores / 2 workers")
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    assert worker_env(plan)["OMP_NUM_THREADS"] == "5"


# -------------------------------------------------------------------------------- teardown


def _gloo_threads() -> int:
    return sum(
        (task / "comm").read_text().strip() == "pt_gloo_runloop"
        for task in Path("/proc/self/task").iterdir()
    )


def test_teardown_ends_groups_that_a_reference_cycle_still_holds():
    """A DDP model caught in a reference cycle keeps its group alive past the caller's `del`;
    the cyclic GC would free it (and join gloo's threads, holding the GIL) at a random later
    moment. teardown frees it first, so the group's threads are gone when it returns."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from distrain.parallel.device import teardown

    before = _gloo_threads()
    # Inside the block: its exit would destroy a group that teardown left behind.
    with process_group():
        group = dist.new_group([0])
        model = DistributedDataParallel(torch.nn.Linear(4, 4), process_group=group)
        model.loss = model(torch.ones(2, 4)).sum()
        model.loss.backward()
        model.cycle = model  # as closures, hooks and bound methods often do
        del model, group
        assert _gloo_threads() > before
        teardown(synchronize=True)
        assert not dist.is_initialized()
        assert _gloo_threads() == before
