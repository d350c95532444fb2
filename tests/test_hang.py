"""Hang detection: a worker stopped from outside (SIGSTOP) and a rank stuck in backward
(debug.hang_at_step) are named by rank, step and phase; the others' stacks are dumped; the job
exits non-zero and, with --max-restarts, resumes and finishes. A save and a resume on storage so
slow that each takes longer than the hang timeout finish (the bytes they move are progress),
while a storage that stops moving bytes mid-save or mid-verification is still a hang. Also the
triage's wording and the collective timeout reaching every process group."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from helpers import cli_in_process, start_train, train_cli

from distrain.checkpoint.load import load
from distrain.checkpoint.storage import CHUNK_BYTES, Storage
from distrain.observe import watchdog
from distrain.observe.heartbeat import Heartbeat, read_heartbeats
from distrain.observe.metrics import read_metrics
from distrain.observe.watchdog import HANG_EXIT_CODE, Watchdog, others_quiet_s, rank_list, triage

HANG_S = 10
# Detection takes hang_timeout_s after the waiting ranks block (within a step of the stop), plus
# a watchdog tick and the wait for the others' dumps; 10 s covers that on a loaded 2-core machine.
MARGIN_S = 10
FIELDS = {
    "training__global_batch_size": 8,
    "training__micro_batch_size": 2,
    "training__seq_len": 64,
    "checkpoint__interval_steps": 2,
    "checkpoint__at_end": False,
    "watchdog__hang_timeout_s": HANG_S,
}


def read_hangs(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "hangs.jsonl").read_text().splitlines()]


def test_rank_list_names_runs_of_ranks():
    assert rank_list([3]) == "rank 3"
    assert rank_list([0, 1, 2]) == "ranks 0-2"
    assert rank_list([5, 0, 1, 3]) == "ranks 0-1,3,5"


def _beat(rank: int, *, time_: float, hang: bool, seqs: dict | None = None, **kw) -> dict:
    collective = None
    if seqs is not None:
        op = kw.get("op", "all_reduce")
        collective = {"op": op, "seq": seqs["0"], "group": "0", "group_name": "g"}
        collective["seqs"] = seqs
    return {
        "rank": rank,
        "time": time_,
        "hang": hang,
        "collective": collective,
        "step": kw.get("step", 41),
        "phase": kw.get("phase", "backward"),
        "stalled_s": kw.get("stalled_s", 62.0),
    }


def test_triage_names_the_rank_behind_and_what_the_others_wait_in():
    now = 1000.0
    beats = {r: _beat(r, time_=now, hang=True, seqs={"0": 812}) for r in range(3)}
    beats[3] = _beat(3, time_=now, hang=True, seqs={"0": 811})
    verdict = triage(beats, world_size=4, now=now, stale_s=5)
    assert verdict["stuck"] == [3]
    assert verdict["message"] == (
        "hang: rank 3 stopped in backward of step 41 for 62 s; "
        "ranks 0-2 wait in all_reduce #812 (group g)"
    )


def test_triage_names_a_rank_without_heartbeat_and_a_missing_one():
    now = 1000.0
    beats = {0: _beat(0, time_=now, hang=True, seqs={"0": 7})}
    beats[1] = _beat(1, time_=now - 30, hang=False, phase="forward", step=5)
    verdict = triage(beats, world_size=3, now=now, stale_s=5)
    assert verdict["stuck"] == [1, 2]
    assert verdict["unresponsive"] == [1]
    assert (
        "rank 1 stopped responding in forward of step 5 (no heartbeat for 30 s)"
        in (verdict["message"])
    )
    assert "rank 2 never wrote a heartbeat" in verdict["message"]
    assert verdict["message"].endswith("rank 0 wait in all_reduce #7 (group g)")


def test_triage_blames_only_the_stopped_rank_when_one_stopped():
    """In a gather whose root waits for a stopped rank, the other ranks have sent their part
    and gone on to the next collective: the root is behind them, but not stuck of its own."""
    now = 1000.0
    beats = {0: _beat(0, time_=now, hang=True, seqs={"0": 47}, op="gather")}
    for r in (1, 2):
        beats[r] = _beat(r, time_=now, hang=True, seqs={"0": 48}, op="scatter")
    beats[3] = _beat(3, time_=now - 12, hang=False, phase="checkpoint", step=4)
    verdict = triage(beats, world_size=4, now=now, stale_s=5)
    assert verdict["stuck"] == [3]
    assert verdict["waiting"] == [0, 1, 2]
    assert verdict["message"] == (
        "hang: rank 3 stopped responding in checkpoint of step 4 (no heartbeat for 12 s); "
        "rank 0 wait in gather #47 (group g); ranks 1-2 wait in scatter #48 (group g)"
    )


def test_a_rank_waiting_on_one_that_moves_is_not_stalled_longer_than_it():
    """A rank done with its share of a checkpoint waits in a collective on the ranks still
    writing (or verifying) theirs: it stalled only as long as they did. A rank that stopped
    dates its last progress by its last heartbeat; one done or acting on a hang does not count."""
    now = 1000.0
    beats = {
        0: _beat(0, time_=now, hang=False, stalled_s=50.0),  # this rank: waits
        1: _beat(1, time_=now - 40, hang=False, stalled_s=25.0),  # SIGSTOPped 40 s ago
        2: _beat(2, time_=now, hang=False, stalled_s=0.0, phase="done"),
        3: _beat(3, time_=now, hang=True, stalled_s=0.0),
        4: _beat(4, time_=now - 3, hang=False, stalled_s=5.0),  # moved 8 s ago
    }
    assert others_quiet_s(beats, rank=0, now=now) == 8.0
    del beats[4]
    assert others_quiet_s(beats, rank=0, now=now) == 65.0
    assert others_quiet_s({0: beats[0]}, rank=0, now=now) == float("inf")


def test_a_large_tensor_reports_progress_per_chunk_both_ways(tmp_path):
    """torch.save writes a tensor in one call and torch.load reads it in one: a multi-GB tensor
    on slow storage must still report progress while it moves, chunk by chunk."""
    moved: list[int] = []
    storage = Storage(str(tmp_path), on_progress=moved.append)
    path = storage.path("ckpt")
    state = {"w": torch.randn(3 * CHUNK_BYTES // 4 + 5)}  # 3 chunks and a bit
    writer = storage.dcp_writer(path)
    dcp.save(state, storage_writer=writer)
    assert sum(moved) == sum(f["size"] for f in writer.written.values())
    assert max(moved) == CHUNK_BYTES and moved.count(CHUNK_BYTES) == 3, moved
    for what in ("sha256", "load"):
        moved.clear()
        if what == "sha256":
            storage.sha256(f"{path}/__0_0.distcp", max_bytes=writer.written["__0_0.distcp"]["size"])
        else:
            load(storage, path, {"w": torch.zeros_like(state["w"])})
        assert max(moved) == CHUNK_BYTES and moved.count(CHUNK_BYTES) == 3, (what, moved)


def test_collective_timeout_reaches_every_group(tmp_path):
    """comm.collective_timeout_s on the world group and every group of the mesh."""
    from distrain.config.schema import Config
    from distrain.parallel.device import init_distributed
    from distrain.parallel.mesh import ParallelDims

    assert not dist.is_initialized()
    init_distributed("cpu", timeout_s=7)
    try:
        mesh, dp_mesh = ParallelDims.from_config(
            Config().parallel, 1, optimizer_averages=False
        ).build_mesh("cpu", timeout_s=7)
        groups = [dist.group.WORLD, dp_mesh.get_group()]
        groups += [mesh.get_group(axis) for axis in ("pp", "dp_replicate", "dp_shard", "cp", "tp")]
        for group in groups:
            backend = group._get_backend(torch.device("cpu"))
            assert backend.options._timeout == timedelta(seconds=7), group.group_name
    finally:
        dist.destroy_process_group()


def _wait_for_step(run: Path, rank: int, step: int, proc, timeout: float = 180) -> dict:
    """Rank `rank`'s first-attempt heartbeat once it reached `step` (and a checkpoint exists)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[1][-4000:]
        beat = read_heartbeats(run, attempt=0).get(rank)
        committed = list((run / "checkpoints").glob("step-*/MANIFEST.json"))
        if beat and beat["step"] >= step and committed:
            return beat
        time.sleep(0.05)
    raise AssertionError(f"rank {rank} did not reach step {step}")


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state in ("Z", "X")


@pytest.mark.slow
def test_sigstopped_rank_is_named_and_the_job_resumes(tmp_path, capsys):
    run = tmp_path / "run"
    # 16 steps: the stop lands at step 3 or 4 (the heartbeat is polled every 0.05 s), far from
    # the end, and the resumed attempt trains only the rest.
    proc = start_train(run, "--nproc", "4", "--max-restarts", "1", **FIELDS, training__steps=16)
    pid = None
    try:
        pid = _wait_for_step(run, 3, 3, proc)["pid"]
        os.kill(pid, signal.SIGSTOP)
        stopped_at = time.time()
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
        if pid is not None and not _gone(pid):
            os.kill(pid, signal.SIGKILL)
    assert proc.returncode == 0, err[-4000:]

    (hang,) = read_hangs(run)
    assert hang["attempt"] == 0
    assert hang["stuck"] == hang["unresponsive"] == [3]
    assert hang["waiting"] == [0, 1, 2]
    assert hang["time"] - stopped_at <= HANG_S + MARGIN_S, hang["time"] - stopped_at
    assert "hang: rank 3 stopped responding in " in err
    # What they wait in depends on where the stop hit (an all-reduce in training, DCP's
    # gather and scatter in a checkpoint): the triage's wording is checked on its own above.
    assert " wait in " in err
    # Attempt 0 ended with failed workers (exit 124 from the watchdog, or -9 for the stopped
    # rank the reporter killed, whichever torchrun saw first), hence the restart.
    assert re.search(rf"failed \(exitcode: ({HANG_EXIT_CODE}|-9)\)", err), err[-4000:]
    for rank in range(3):
        stacks = (run / "logs" / f"rank{rank}.stacks").read_text()
        assert "in run_training" in stacks and "Current thread" in stacks
    assert not (run / "logs" / "rank3.stacks").exists()
    # The stopped process was killed (by the reporting rank), not left behind.
    assert _gone(pid)
    # The second attempt resumed from a checkpoint and finished.
    assert "resumed from checkpoint" in (run / "logs" / "rank0.log").read_text()
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r][-1] == 16

    report = cli_in_process(capsys, "diagnose", str(run))
    assert report.returncode == 0, report.stderr
    assert "attempt 0: hang: rank 3 stopped responding in " in report.stdout
    assert "attempt 1: finished" in report.stdout
    assert "restarts: 1" in report.stdout


@pytest.fixture(scope="module")
def hung_in_backward(tmp_path_factory) -> tuple[Path, object]:
    """A 2-rank run whose rank 1 sleeps forever inside backward of step 3."""
    run = tmp_path_factory.mktemp("hang") / "run"
    result = train_cli(
        run, 2, **FIELDS, training__steps=6, debug__hang_at_step=3, debug__hang_rank=1
    )
    return run, result


@pytest.mark.slow
def test_rank_stuck_in_backward_is_named_with_its_phase(hung_in_backward):
    run, result = hung_in_backward
    assert result.returncode != 0
    line = "hang: rank 1 stopped in backward of step 3 for "
    assert line in result.stderr, result.stderr[-4000:]
    assert "rank 0 wait in all_reduce #" in result.stderr
    # Both ranks could act: both dumped stacks; rank 1's shows where it sleeps.
    assert "in sleep_forever" in (run / "logs" / "rank1.stacks").read_text()
    assert "in train_step" in (run / "logs" / "rank0.stacks").read_text()
    for rank in range(2):
        trace = json.loads((run / "flight" / f"rank{rank}.json").read_text())
        assert trace["entries"], rank


@pytest.mark.slow
def test_diagnose_names_the_hung_rank(hung_in_backward, capsys):
    run, _ = hung_in_backward
    result = cli_in_process(capsys, "diagnose", str(run))
    assert result.returncode == 0, result.stderr
    assert "rank 1 stopped in backward of step 3" in result.stdout
    assert "in sleep_forever" in result.stdout


# --- slow and stalled checkpoint storage (tests/slow_storage.py) ----------------------------------

SLOW_HANG_S = 3
# The tiny default model's checkpoint is ~11 MB: ~4.4 s to write at this pace, twice that to
# resume (verification reads every byte, then the load does); one 1 MiB chunk takes 0.4 s.
SLOW_BYTES_PER_S = 2.5e6
SLOW_FIELDS = {
    "training__global_batch_size": 2,
    "training__micro_batch_size": 2,
    "training__seq_len": 64,
    "checkpoint__interval_steps": 2,
    "checkpoint__at_end": False,
    "watchdog__hang_timeout_s": SLOW_HANG_S,
}


def _train_on_slow_storage(
    run: Path, checkpoints: Path, *, stall: str | None = None, **fields: object
) -> subprocess.CompletedProcess:
    """Train 1 rank in a process of its own (a hang ends it with os._exit) whose checkpoints go
    to `checkpoints` at SLOW_BYTES_PER_S, or stall forever reading or writing a shard."""
    fields = {**SLOW_FIELDS, "checkpoint__dir": f"slowfile://{checkpoints}", **fields}
    args = [sys.executable, str(Path(__file__).with_name("slow_storage.py")), str(run)]
    args += [json.dumps(fields), "--bytes-per-s", str(SLOW_BYTES_PER_S)]
    if stall is not None:
        args += ["--stall", stall]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run(args, capture_output=True, text=True, timeout=240, env=env)


def _same_run(saved_run: Path, run: Path) -> Path:
    """A fresh run dir of the run that wrote `saved_run`'s checkpoints (its run id), as when
    the run resumes on another machine: only its own checkpoints are resumed."""
    run.mkdir()
    shutil.copy(saved_run / "run_id", run / "run_id")
    return run


def _log(run: Path) -> str:
    return (run / "logs" / "rank0.log").read_text()


def _checkpoint_bytes(checkpoints: Path) -> int:
    manifest = json.loads(next(checkpoints.glob("step-*/MANIFEST.json")).read_text())
    return sum(f["size"] for f in manifest["files"].values())


@pytest.fixture(scope="module")
def slow_saved(tmp_path_factory) -> tuple[Path, Path, subprocess.CompletedProcess]:
    """A 2-step run whose checkpoint at step 2 is written at SLOW_BYTES_PER_S."""
    root = tmp_path_factory.mktemp("slow")
    run, checkpoints = root / "run", root / "checkpoints"
    return run, checkpoints, _train_on_slow_storage(run, checkpoints, training__steps=2)


@pytest.mark.slow
def test_a_save_slower_than_the_hang_timeout_completes(slow_saved):
    run, checkpoints, result = slow_saved
    assert result.returncode == 0, result.stderr[-4000:]
    assert not (run / "hangs.jsonl").exists()
    # Its pace alone keeps the save past the timeout, and it was.
    assert _checkpoint_bytes(checkpoints) / SLOW_BYTES_PER_S > SLOW_HANG_S
    written = float(re.search(r"checkpoint step 2 \(\w+\) written in ([\d.]+)s", _log(run))[1])
    assert written > SLOW_HANG_S, written
    assert read_heartbeats(run)[0]["phase"] == "done"  # the watchdog watched to the end


@pytest.mark.slow
def test_a_resume_slower_than_the_hang_timeout_completes(slow_saved, tmp_path):
    saved_run, checkpoints, saved = slow_saved
    assert saved.returncode == 0, saved.stderr[-4000:]
    run = _same_run(saved_run, tmp_path / "run")
    start = time.monotonic()
    result = _train_on_slow_storage(run, checkpoints, training__steps=3)
    assert result.returncode == 0, result.stderr[-4000:]
    assert not (run / "hangs.jsonl").exists()
    assert "resumed from checkpoint step-00000002" in _log(run)
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r] == [3]
    # Verification and the load each read every byte at the slow pace.
    assert 2 * _checkpoint_bytes(checkpoints) / SLOW_BYTES_PER_S > 2 * SLOW_HANG_S
    assert time.monotonic() - start > 2 * SLOW_HANG_S


def _assert_caught_stalled(run: Path, result: subprocess.CompletedProcess, step: int) -> None:
    assert result.returncode == HANG_EXIT_CODE, result.stderr[-4000:]
    (hang,) = read_hangs(run)
    assert hang["stuck"] == [] and hang["waiting"] == [0], hang
    assert read_heartbeats(run)[0]["phase"] == "checkpoint"
    assert read_heartbeats(run)[0]["step"] == step
    assert "in stall_forever" in (run / "logs" / "rank0.stacks").read_text()


@pytest.mark.slow
def test_a_save_whose_storage_stops_moving_bytes_is_a_hang(tmp_path):
    run = tmp_path / "run"
    result = _train_on_slow_storage(run, tmp_path / "checkpoints", stall="write", training__steps=2)
    _assert_caught_stalled(run, result, step=2)


@pytest.mark.slow
def test_a_verification_whose_storage_stops_moving_bytes_is_a_hang(slow_saved, tmp_path):
    saved_run, checkpoints, saved = slow_saved
    assert saved.returncode == 0, saved.stderr[-4000:]
    run = _same_run(saved_run, tmp_path / "run")
    result = _train_on_slow_storage(run, checkpoints, stall="read", training__steps=3)
    _assert_caught_stalled(run, result, step=0)
    assert "in sha256" in (run / "logs" / "rank0.stacks").read_text()


# ------------------------------------------------------ the watchdog's file operations (fake clock)


class _Ticks:
    """Stands in for the watchdog's stop event and clock: each wait is one tick of a fake
    clock, during which the rank makes progress (as a training step does); stops after
    `seconds`. `at` maps a fake time to something to do then."""

    def __init__(self, heartbeat: Heartbeat, seconds: float, at: dict | None = None):
        self.now, self.end, self.heartbeat, self.at = 1000.0, 1000.0 + seconds, heartbeat, at or {}

    def monotonic(self) -> float:
        return self.now

    def wait(self, tick_s: float) -> bool:
        for when in [w for w in self.at if self.now < w <= self.now + tick_s]:
            self.at.pop(when)()
        self.now += tick_s
        self.heartbeat.mark("forward")
        return self.now > self.end


def _fake_watchdog(tmp_path: Path, monkeypatch, timeout_s: float, ticks: dict):
    """A watchdog on a fake clock, its heartbeat writes and hang.json polls timed."""
    hb = Heartbeat(tmp_path, 0, 2)
    dog = Watchdog(
        hb, run_dir=tmp_path, timeout_s=timeout_s, logger=logging.getLogger("t"), nccl=False
    )
    clock = _Ticks(hb, **ticks)
    monkeypatch.setattr(dog, "_stop", clock)
    monkeypatch.setattr(watchdog.time, "monotonic", clock.monotonic)
    writes, polls = [], []
    write, announced = hb.write, dog._announced
    monkeypatch.setattr(hb, "write", lambda **kw: (writes.append(clock.now), write(**kw)))
    monkeypatch.setattr(dog, "_announced", lambda: (polls.append(clock.now), announced())[1])
    return dog, clock, writes, polls


def test_watchdog_file_operations_are_bounded(tmp_path, monkeypatch):
    """An hour of 1-s ticks at the default timeout: the heartbeat is rewritten every 30 s, not
    every tick (a create and a rename each), and hang.json read every 10 s (an open each): 3
    metadata operations per second per rank before, 2/30 + 1/10 = 0.17 now."""
    hour = 3600
    dog, _, writes, polls = _fake_watchdog(tmp_path, monkeypatch, 600.0, {"seconds": hour})
    dog._loop()
    assert dog.tick_s == 1.0
    assert hour / 30 - 1 <= len(writes) <= hour / 30 + 1
    assert hour / 10 - 1 <= len(polls) <= hour / 10 + 1
    # Still fresh for the others' triage: never older than a fifth of the staleness bound.
    gaps = [b - a for a, b in zip(writes, writes[1:], strict=False)]
    assert max(gaps) <= dog.write_every_s + dog.tick_s and dog.write_every_s <= dog.stale_s / 5


def test_watchdog_sees_an_announced_hang_within_the_poll_interval(tmp_path, monkeypatch):
    announced_at = 1100.5

    def announce() -> None:
        note = {"attempt": 0, "rank": 1, "time": time.time()}
        (tmp_path / "heartbeat" / "hang.json").write_text(json.dumps(note))

    ticks = {"seconds": 600, "at": {announced_at: announce}}
    dog, clock, _, _ = _fake_watchdog(tmp_path, monkeypatch, 600.0, ticks)
    seen = []
    monkeypatch.setattr(dog, "_on_hang", lambda stalled: seen.append(clock.now))

    def exit_(code: int) -> None:
        raise SystemExit(code)

    monkeypatch.setattr(watchdog.os, "_exit", exit_)
    with pytest.raises(SystemExit) as ended:
        dog._loop()
    assert ended.value.code == HANG_EXIT_CODE
    assert announced_at < seen[0] <= announced_at + dog.poll_every_s + dog.tick_s
