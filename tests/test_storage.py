"""Storage's retry policy: transient errors are retried with backoff until a deadline, then
reported in one line naming the URL; permanent ones are raised at once; and non-essential calls
(retention) never stop a save. Local durability: every file is fsynced, an atomic write also
fsyncs its folder after the rename, and a save never calls the node-wide os.sync()."""

import errno
import logging
import os
import time

import pytest
import torch

from distrain.checkpoint.checkpointer import Checkpointer
from distrain.checkpoint.manifest import committed
from distrain.checkpoint.storage import Storage, StorageError
from distrain.errors import CheckpointError

LOG = logging.getLogger("distrain_test.storage")


class Flaky:
    """A storage call that raises `error` for its first `failures` calls, then returns "ok"."""

    def __init__(self, error: BaseException, failures: int):
        self.error, self.failures, self.calls = error, failures, 0

    def __call__(self) -> str:
        self.calls += 1
        if self.calls <= self.failures:
            raise self.error
        return "ok"


@pytest.fixture
def distrain_log(caplog, monkeypatch):
    """caplog hearing the `distrain` logger, which a run's setup_logging stops propagating."""
    monkeypatch.setattr(logging.getLogger("distrain"), "propagate", True)
    with caplog.at_level(logging.INFO, logger="distrain"):
        yield caplog


def test_transient_error_is_retried_until_it_passes(tmp_path, distrain_log):
    caplog = distrain_log
    call = Flaky(ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused"), failures=3)
    start = time.monotonic()
    assert Storage(str(tmp_path), retry_s=10).call("listing x", call) == "ok"
    assert call.calls == 4
    assert time.monotonic() - start >= 0.7  # backoff 0.1 s, 0.2 s, then 0.4 s
    # The outage is named twice, as it begins and as it ends, however many retries it took.
    assert [r.getMessage() for r in caplog.records] == [
        f"storage {tmp_path} unreachable: listing x failed (ConnectionRefusedError: [Errno 111] "
        "Connection refused); retrying for up to 10 s (checkpoint.storage_retry_s)",
        f"storage {tmp_path} reachable again: listing x succeeded after 4 attempts; unreachable "
        f"for {caplog.records[1].args[-1]:.1f} s",
    ]
    assert 0.7 <= caplog.records[1].args[-1] < 5


def test_a_call_that_succeeds_at_once_logs_nothing(tmp_path, distrain_log):
    assert Storage(str(tmp_path), retry_s=10).call("listing", lambda: "ok") == "ok"
    assert distrain_log.records == []


def test_outage_longer_than_the_deadline_is_one_line_naming_the_url():
    storage = Storage("memory://bucket/run", retry_s=0.5)
    call = Flaky(ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused"), failures=99)
    start = time.monotonic()
    with pytest.raises(StorageError) as failed:
        storage.call("writing memory://bucket/run/x", call)
    waited = time.monotonic() - start
    assert 0.3 <= waited <= 0.5 and call.calls == 3  # 0.1 + 0.2 s of backoff; 0.4 more > 0.5
    message = str(failed.value)
    assert "\n" not in message
    assert message.startswith(
        "storage memory://bucket/run unreachable: writing memory://bucket/run/x failed "
        "(ConnectionRefusedError: [Errno 111] Connection refused) after 3 attempt(s) in "
    )
    assert message.endswith("(checkpoint.storage_retry_s = 0.5)")


@pytest.mark.parametrize(
    "error",
    [FileNotFoundError("gone"), OSError(errno.ENOSPC, "No space left"), PermissionError("no")],
    ids=["missing", "disk_full", "permission"],
)
def test_permanent_errors_are_not_retried(tmp_path, error):
    call = Flaky(error, failures=99)
    with pytest.raises(type(error)):
        Storage(str(tmp_path), retry_s=10).call("reading", call)
    assert call.calls == 1


def test_retention_failure_is_a_warning_not_a_crash(tmp_path, monkeypatch, caplog):
    storage = Storage(str(tmp_path))
    ckpt = Checkpointer(
        storage, run_id="test", layout="test", async_mode="off", keep_temporary=1, logger=LOG
    )
    state = {"w": torch.ones(4)}
    ckpt.save(1, state, permanent=False)

    def unreachable(*_args, **_kwargs):
        raise StorageError(f"storage {storage.url} unreachable: listing failed")

    monkeypatch.setattr(storage, "listdir", unreachable)
    with caplog.at_level(logging.WARNING, logger=LOG.name):
        ckpt.save(2, state, permanent=False)
    assert ckpt.newest_committed == 2 and ckpt.failed_in_a_row == 0
    assert f"retention skipped on {tmp_path}: storage {tmp_path} unreachable" in caplog.text
    monkeypatch.undo()
    assert [e.step for e in committed(storage)] == [1, 2]  # step 1 waits for the next prune


def test_missing_s3_credentials_are_not_retried():
    botocore = pytest.importorskip("botocore.exceptions")
    storage = Storage("memory://retry", retry_s=60)
    call = Flaky(botocore.NoCredentialsError(), failures=5)
    start = time.monotonic()
    with pytest.raises(botocore.NoCredentialsError):
        storage.call("listing", call)
    assert call.calls == 1 and time.monotonic() - start < 1


def test_an_unwritable_checkpoint_location_is_one_line_before_the_first_step(tmp_path):
    (tmp_path / "file").write_text("in the way")
    storage = Storage(str(tmp_path / "file" / "checkpoints"), retry_s=60)
    with pytest.raises(CheckpointError) as raised:
        storage.check_writable()
    message = str(raised.value)
    assert message.startswith(f"checkpoint location {tmp_path}/file/checkpoints is not writable (")
    assert "\n" not in message
    Storage(str(tmp_path / "ok")).check_writable()
    assert list((tmp_path / "ok").iterdir()) == []  # the probe is gone


def _fsync_recorder(monkeypatch) -> list[tuple[str, str]]:
    """Patch os.fsync and os.replace to log ("fsync", path of the fd) and ("replace", target)."""
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src, dst) -> None:
        real_replace(src, dst)
        events.append(("replace", os.fspath(dst)))

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    return events


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd")
def test_atomic_write_fsyncs_the_folder_after_the_rename(tmp_path, monkeypatch):
    events = _fsync_recorder(monkeypatch)
    target = tmp_path / "MANIFEST.json"
    Storage(str(tmp_path)).write_text_atomic(str(target), "{}")
    assert target.read_text() == "{}"
    replaced = events.index(("replace", str(target)))
    assert events[replaced - 1][0] == "fsync"  # the file's data, before it gets its name
    assert ("fsync", str(tmp_path)) in events[replaced + 1 :]  # the name itself


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd")
def test_local_save_fsyncs_each_file_and_never_syncs_the_node(tmp_path, monkeypatch):
    events = _fsync_recorder(monkeypatch)
    syncs: list[int] = []
    monkeypatch.setattr(os, "sync", lambda: syncs.append(1))
    ckpt = Checkpointer(
        Storage(str(tmp_path)),
        run_id="test",
        layout="test",
        async_mode="off",
        keep_temporary=1,
        logger=LOG,
    )
    ckpt.save(1, {"w": torch.ones(4)}, permanent=False)
    step = tmp_path / "step-00000001"
    fsynced = {path for kind, path in events if kind == "fsync"}
    shards = {str(p) for p in step.glob("*.distcp")}
    assert shards and shards <= fsynced
    assert str(step / ".metadata.tmp") in fsynced  # renamed to .metadata after its fsync
    assert len(syncs) == 0


class StoreOpens:
    """fsspec's in-memory filesystem with its opens for writing of checkpoint shards (.distcp)
    and metadata (.metadata*) failing: `failures[kind]` times, with `error(kind)`; `opened`
    counts the write opens of each kind."""

    def __init__(self, monkeypatch, error, **failures: int):
        from fsspec.implementations.memory import MemoryFileSystem

        self.error, self.failures = error, failures
        self.opened = {"shard": 0, "metadata": 0}
        real_open = MemoryFileSystem._open

        def _open(fs, path, mode="rb", *args, **kwargs):
            kind = "shard" if path.endswith(".distcp") else "metadata"
            if "w" in mode and (kind == "shard" or ".metadata" in path):
                self.opened[kind] += 1
                if self.failures.get(kind, 0) > 0:
                    self.failures[kind] -= 1
                    return self.error(kind, real_open(fs, path, mode, *args, **kwargs))
            return real_open(fs, path, mode, *args, **kwargs)

        monkeypatch.setattr(MemoryFileSystem, "_open", _open)


def _memory_checkpointer(name: str, retry_s: float) -> tuple[Storage, Checkpointer]:
    storage = Storage(f"memory://{name}-{os.getpid()}-{time.monotonic_ns()}/run", retry_s=retry_s)
    ckpt = Checkpointer(
        storage, run_id="test", layout="test", async_mode="off", keep_temporary=1, logger=LOG
    )
    return storage, ckpt


def _refused(error: BaseException):
    def fail(kind, stream):
        stream.close()
        raise error

    return fail


def test_an_object_store_outage_during_dcp_writes_is_ridden_out(monkeypatch, distrain_log):
    """DCP's shard and metadata writes on an object store go through the retry policy: the
    save commits, its manifest describes what is there, and each outage is logged."""
    from distrain.checkpoint.manifest import verify

    opens = StoreOpens(
        monkeypatch, _refused(ConnectionResetError(errno.ECONNRESET, "reset")), shard=2, metadata=1
    )
    storage, ckpt = _memory_checkpointer("outage", retry_s=30)
    ckpt.save(1, {"w": torch.arange(4.0)}, permanent=False)
    assert opens.failures == {"shard": 0, "metadata": 0}
    assert opens.opened == {"shard": 3, "metadata": 2}
    (entry,) = committed(storage)
    assert entry.step == 1 and verify(storage, entry) is None
    assert ckpt.failed_in_a_row == 0
    log = distrain_log.text
    assert "writing this rank's checkpoint files failed (ConnectionResetError" in log
    assert "writing this rank's checkpoint files succeeded after 3 attempts" in log
    assert "writing the checkpoint's metadata succeeded after 2 attempts" in log


class _FullStore:
    """A write stream of a store that fills up: its writes after the first two raise ENOSPC
    (torch.save then reports "unexpected pos", a RuntimeError)."""

    def __init__(self, stream):
        self.stream, self.writes = stream, 0

    def write(self, data):
        self.writes += 1
        if self.writes > 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return self.stream.write(data)

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.stream.close()

    def __getattr__(self, name):
        return getattr(self.stream, name)


@pytest.mark.parametrize(
    "error",
    [_refused(PermissionError(errno.EACCES, "denied")), lambda kind, stream: _FullStore(stream)],
    ids=["refused open", "full store mid-write"],
)
def test_a_permanent_dcp_write_error_is_not_retried(monkeypatch, error):
    """Not even when torch.save reports the full store as something that might pass: the first
    error a write hit decides."""
    opens = StoreOpens(monkeypatch, error, shard=100)
    storage, ckpt = _memory_checkpointer("permanent", retry_s=30)
    start = time.monotonic()
    ckpt.save(1, {"w": torch.arange(4.0)}, permanent=False)
    assert opens.opened["shard"] == 1 and time.monotonic() - start < 5
    assert committed(storage) == [] and ckpt.failed_in_a_row == 1
