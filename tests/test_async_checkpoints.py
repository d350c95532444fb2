"""Background saves (checkpoint.async_mode = "thread" and "process"): training goes on while a
save is written, a rank killed with SIGKILL from outside during a background save resumes from the
newest complete checkpoint bit for bit, the checkpoint holds the weights of its step although
training changed them right after staging, the staging buffers are reused from save to save,
a killed writer process fails its save and the next one commits, and what saves cost reaches
metrics, `status` and `diagnose`."""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from helpers import SMALL_RUN, losses, run_cli, start_train, train_cli, worker_pid

from distrain.checkpoint.checkpointer import Checkpointer
from distrain.checkpoint.manifest import committed
from distrain.checkpoint.staging import Stager
from distrain.checkpoint.storage import Storage
from distrain.observe.metrics import read_metrics

LOG = logging.getLogger("distrain_test.async_checkpoints")
STEPS = 8
FIELDS = {
    "training__steps": STEPS,
    **SMALL_RUN,
    "checkpoint__interval_steps": 2,
}
MODES = ("thread", "process")
HELD = 4


def _logged_steps(run_dir: Path) -> list[int]:
    rows = read_metrics(run_dir / "metrics.jsonl", all_attempts=True)
    return [r["step"] for r in rows if "loss" in r]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The run uninterrupted, its saves synchronous: both modes must reproduce its losses."""
    run = tmp_path_factory.mktemp("reference")
    result = train_cli(run, 2, **FIELDS, checkpoint__async_mode="off")
    assert result.returncode == 0, result.stderr[-4000:]
    return run


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_sigkill_during_a_background_save_resumes_bit_exact(tmp_path, reference, mode):
    fields = dict(FIELDS, checkpoint__async_mode=mode)
    run = tmp_path / "run"
    # Step 4's save is written, then held uncommitted in its writer thread: training goes on
    # past it (the step waited only for staging) until step 6's save waits for it.
    agent = start_train(
        run, "--nproc", "2", "--max-restarts", "1", **fields, debug__hold_checkpoint_step=HELD
    )
    try:
        log = run / "logs" / "rank0.log"
        deadline = time.monotonic() + 240
        while not (
            log.exists()
            and "debug.hold_checkpoint_step" in log.read_text()
            and max(_logged_steps(run), default=0) >= HELD + 1
        ):
            assert time.monotonic() < deadline and agent.poll() is None, agent.poll()
            time.sleep(0.05)
        torn = run / "checkpoints" / f"step-{HELD:08d}"
        assert torn.is_dir() and not (torn / "MANIFEST.json").exists()
        pid = worker_pid(agent.pid, 1)
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        _, stderr = agent.communicate(timeout=300)
    finally:
        if agent.poll() is None:
            agent.kill()
    assert agent.returncode == 0, stderr[-4000:]
    text = (run / "logs" / "rank0.log").read_text()
    assert "resumed from checkpoint step-00000002" in text, text[-3000:]
    assert losses(read_metrics(run / "metrics.jsonl")) == losses(
        read_metrics(reference / "metrics.jsonl")
    )
    assert [e.step for e in committed(Storage(str(run / "checkpoints")))][-1] == STEPS


@pytest.mark.parametrize("mode", MODES)
def test_saves_cost_reaches_metrics_status_and_diagnose(tmp_path, check_ok, mode):
    run = tmp_path / "run"
    check_ok(train_cli(run, 1, **FIELDS, checkpoint__async_mode=mode))
    rows = [r for r in read_metrics(run / "metrics.jsonl") if "checkpoint_stall_s" in r]
    assert [r["step"] for r in rows] == [2, 4, 6, 8]
    for r in rows:
        assert 0 < r["checkpoint_stall_s"] and 0 < r["checkpoint_write_s"]
        assert r["checkpoint_bytes"] > 3_000_000  # the tiny model and its AdamW moments
    status = run_cli("status", str(run)).stdout
    assert "checkpoint saves: 4, 0 failed; last (step 8): training stalled" in status, status
    diagnosis = run_cli("diagnose", str(run)).stdout
    assert "checkpoint saves: 4, 0 failed" in diagnosis, diagnosis


def _checkpointer(tmp_path: Path, mode: str, *, pinned: bool = False) -> Checkpointer:
    return Checkpointer(
        Storage(str(tmp_path)),
        run_id="test",
        layout="test",
        async_mode=mode,
        keep_temporary=2,
        logger=LOG,
        pinned_staging=pinned,
    )


@pytest.mark.parametrize("mode", MODES)
def test_the_checkpoint_holds_the_staged_weights(tmp_path, monkeypatch, mode):
    """The state changes as soon as save() returns, while the writer is held before writing:
    the checkpoint (its hashes verified on restore) holds the values of its step."""
    ckpt = _checkpointer(tmp_path, mode)
    release = threading.Event()
    real_writer = ckpt.storage.dcp_writer

    def held_writer(path: str):
        release.wait(30)
        return real_writer(path)

    monkeypatch.setattr(ckpt.storage, "dcp_writer", held_writer)
    state = {"model": {"w": torch.full((256, 256), 1.0)}}
    ckpt.save(1, state, permanent=False)
    state["model"]["w"].fill_(99.0)  # the next optimizer step, before anything is written
    release.set()
    ckpt.wait()
    ckpt.close(timeout_s=0)
    target = {"model": {"w": torch.zeros(256, 256)}}
    assert ckpt.restore_latest(target) == 1
    assert torch.equal(target["model"]["w"], torch.full((256, 256), 1.0))
    manifest = json.loads((tmp_path / "step-00000001" / "MANIFEST.json").read_text())
    assert manifest["files"]


def test_a_killed_writer_process_fails_its_save_and_the_next_one_commits(tmp_path):
    ckpt = _checkpointer(tmp_path, "process")
    failures: list[str] = []
    ckpt.on_failure = lambda step, message: failures.append(message)
    state = {"model": {"w": torch.full((256, 256), 1.0)}}
    ckpt.save(1, state, permanent=False)
    ckpt.wait()
    writer = ckpt.writer_process
    assert writer is not None
    write = writer.write

    def killed_as_it_writes(*args):
        """SIGKILL the writer process once the save has planned its files, then write."""
        os.kill(writer.process.pid, signal.SIGKILL)
        writer.process.join(10)
        return write(*args)

    writer.write = killed_as_it_writes  # type: ignore[method-assign]
    state["model"]["w"].fill_(2.0)
    ckpt.save(2, state, permanent=False)
    ckpt.wait()
    assert failures == [
        f"checkpoint step-00000002 not saved: writing to {tmp_path} failed on rank 0 "
        f"(CheckpointError: the checkpoint writer process died (exit code -{signal.SIGKILL}))"
    ]
    assert not (tmp_path / "step-00000002").exists()  # removed, never committed
    state["model"]["w"].fill_(3.0)
    ckpt.save(3, state, permanent=False)  # a new writer process
    ckpt.wait()
    ckpt.close(timeout_s=0)
    assert ckpt.newest_committed == 3 and len(failures) == 1
    target = {"model": {"w": torch.zeros(256, 256)}}
    assert _checkpointer(tmp_path, "off").restore_latest(target) == 3
    assert float(target["model"]["w"][0, 0]) == 3.0


def test_staging_reuses_its_buffers():
    stager = Stager(pinned=False, shared=False)
    weights = torch.randn(512, 512)
    first = stager.stage({"model": {"w": weights}})["model"]["w"]
    pointer = first.data_ptr()
    for value in range(3):
        weights.fill_(value)
        staged = stager.stage({"model": {"w": weights}})["model"]["w"]
        assert staged.data_ptr() == pointer and torch.equal(staged, weights)
        assert staged.data_ptr() != weights.data_ptr()
    stager.close()


@pytest.mark.requires("cuda")
def test_pinned_staging_from_cuda_holds_the_weights_of_its_step(tmp_path):
    """On CUDA the staging copy is non-blocking into pinned memory: the checkpoint must still
    hold the values of its step when the weights change on the device right after save()."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    ckpt = _checkpointer(tmp_path, "thread", pinned=True)
    weights = torch.randn(4096, 4096, device="cuda")
    expected = weights.cpu()
    ckpt.save(1, {"model": {"w": weights}}, permanent=False)
    weights.mul_(2.0).add_(1.0)  # queued on the device right behind the staging copy
    ckpt.wait()
    ckpt.close(timeout_s=0)
    target = {"model": {"w": torch.zeros(4096, 4096)}}
    assert ckpt.restore_latest(target) == 1
    assert torch.equal(target["model"]["w"], expected)
