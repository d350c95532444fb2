"""Checkpoints on an object store: a 2-rank run saves (in the background), lists, prunes and
resumes through `s3://` URLs on a real S3-compatible server (tests/s3.py), and continues bit for
bit; a save
reads nothing back and never calls os.sync; the multipart uploads a killed save left are aborted
when its folder is removed; a run survives a short outage of the store and stops cleanly, in one
line naming the URL, on a long one."""

import hashlib
import logging
import os
import re
import time

import fsspec
import pytest
import torch
from batch import Batches, Run
from helpers import losses, start_train, train_cli
from s3 import (  # noqa: F401  (s3: the module-scoped fixture)
    Gateway,
    S3Server,
    expected_kind,
    s3,
    through_gateway,
)

from distrain.checkpoint.checkpointer import Checkpointer
from distrain.checkpoint.manifest import committed
from distrain.checkpoint.storage import Storage
from distrain.observe.metrics import read_metrics

LOG = logging.getLogger("distrain_test.s3_checkpoints")
pytestmark = pytest.mark.requires("s3")

FIELDS = {
    "training__steps": 6,
    "training__global_batch_size": 8,
    "training__micro_batch_size": 4,
    "training__seq_len": 64,
    "checkpoint__interval_steps": 2,
    "checkpoint__keep_temporary": 1,
}


@pytest.mark.slow
def test_save_prune_resume_through_s3(s3: S3Server, tmp_path, check_ok):  # noqa: F811
    assert s3.kind == expected_kind()
    url = s3.url("run/checkpoints")
    # The local reference and the crashing run share a torchrun launch (tests/batch.py); the
    # crash ends it, so it comes last.
    runs = {
        "local": Run(2, FIELDS),
        # Saved in the background (a writer thread), resumed and saved again by writer
        # processes.
        "s3": Run(
            2,
            dict(
                FIELDS, checkpoint__dir=url, checkpoint__async_mode="thread", debug__fail_at_step=5
            ),
        ),
    }
    batches = Batches(runs, tmp_path)
    local = batches.result("local")
    assert local.error is None, local.error
    crashed = batches.result("s3")
    assert crashed.error is not None and "crashes at step 5" in crashed.error, crashed.error
    storage = Storage(url)
    assert [e.step for e in committed(storage)] == [4]  # step 2 pruned (keep_temporary = 1)
    result = check_ok(
        train_cli(
            crashed.run_dir, 2, **FIELDS, checkpoint__dir=url, checkpoint__async_mode="process"
        )
    )
    assert "resumed from checkpoint step-00000004" in result.stderr
    entries = committed(Storage(url))
    assert [(e.step, e.permanent) for e in entries] == [(4, False), (6, True)]
    fs, root = fsspec.url_to_fs(url)
    assert fs.exists(f"{root}/step-00000006/MANIFEST.json")
    want = losses(read_metrics(local.run_dir / "metrics.jsonl"))
    assert losses(read_metrics(crashed.run_dir / "metrics.jsonl")) == want


def test_s3_save_hashes_while_writing_and_reads_nothing_back(
    s3: S3Server,  # noqa: F811
    monkeypatch,
):
    import s3fs

    url = s3.url("nothing-read-back")
    storage = Storage(url)
    ckpt = Checkpointer(
        storage, run_id="test", layout="test", async_mode="off", keep_temporary=1, logger=LOG
    )
    opened: list[tuple[str, str]] = []
    real_open = s3fs.S3FileSystem._open

    def counting_open(self, path, mode="rb", *args, **kwargs):
        opened.append((path.rsplit("/", 1)[-1], mode))
        return real_open(self, path, mode, *args, **kwargs)

    def no_second_pass(*_args, **_kwargs):
        raise AssertionError("a save must not stat or re-read what it wrote")

    with monkeypatch.context() as patch:
        patch.setattr(s3fs.S3FileSystem, "_open", counting_open)
        patch.setattr(s3fs.S3FileSystem, "cat_file", no_second_pass)
        patch.setattr(Storage, "sha256", no_second_pass)
        patch.setattr(Storage, "size", no_second_pass)
        ckpt.save(1, {"w": torch.randn(200, 50), "step": torch.tensor(1)}, permanent=False)
    read = {name for name, mode in opened if "r" in mode}
    assert read <= {"rank0.json", "MANIFEST.json"}  # records for the manifest; no data file
    assert any(name.endswith(".distcp") and "w" in mode for name, mode in opened)
    files = committed(storage)[0].manifest["files"]
    for name, info in files.items():
        data = storage.fs.cat_file(storage.path("step-00000001", name))
        assert info == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def test_s3_save_never_syncs_the_node(s3: S3Server, monkeypatch):  # noqa: F811
    # s3fs streams have no fileno, so DCP's sync_files falls back to os.sync(): every file of
    # every rank would flush the whole node's page cache, for objects that are durable anyway.
    syncs: list[int] = []
    monkeypatch.setattr(os, "sync", lambda: syncs.append(1))
    storage = Storage(s3.url("no-sync"))
    ckpt = Checkpointer(
        storage, run_id="test", layout="test", async_mode="off", keep_temporary=1, logger=LOG
    )
    ckpt.save(1, {"w": torch.randn(200, 50), "step": torch.tensor(1)}, permanent=False)
    assert ckpt.newest_committed == 1
    assert len(syncs) == 0


def _open_uploads(storage: Storage, prefix: str) -> list[str]:
    """Keys of the multipart uploads still open under `prefix` (a key prefix in the bucket)."""
    bucket, _, _ = storage.fs.split_path(storage.root)
    page = storage.fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix)
    return sorted(u["Key"] for u in page.get("Uploads", []))


def _killed_upload(storage: Storage, path: str) -> None:
    """What a save killed mid-upload leaves: a multipart upload at `path` with one part sent."""
    bucket, key, _ = storage.fs.split_path(path)
    upload = storage.fs.call_s3("create_multipart_upload", Bucket=bucket, Key=key)
    storage.fs.call_s3(
        "upload_part",
        Bucket=bucket,
        Key=key,
        UploadId=upload["UploadId"],
        PartNumber=1,
        Body=b"\0" * 1024,
    )


def test_removing_a_prefix_aborts_the_uploads_open_under_it(s3: S3Server):  # noqa: F811
    storage = Storage(s3.url("uploads"))
    _killed_upload(storage, storage.path("step-1", "__0_0.distcp"))
    _killed_upload(storage, storage.path("step-1", "sub", "__1_0.distcp"))
    _killed_upload(storage, storage.path("step-10", "__0_0.distcp"))  # a sibling, same prefix
    storage.remove(storage.path("step-1"))
    assert _open_uploads(storage, "uploads/") == ["uploads/step-10/__0_0.distcp"]
    storage.remove(storage.path("step-10", "__0_0.distcp"))  # a single file's upload, too
    assert _open_uploads(storage, "uploads/") == []


def test_next_save_of_a_step_aborts_a_killed_saves_uploads(s3: S3Server):  # noqa: F811
    storage = Storage(s3.url("killed-then-saved"))
    # Nothing but an open upload: the step folder does not even list.
    _killed_upload(storage, storage.path("step-00000003", "__0_0.distcp"))
    ckpt = Checkpointer(
        storage, run_id="test", layout="test", async_mode="off", keep_temporary=1, logger=LOG
    )
    ckpt.save(3, {"w": torch.randn(20, 5)}, permanent=False)
    assert ckpt.newest_committed == 3
    assert _open_uploads(storage, "killed-then-saved/") == []


def test_pruning_a_torn_save_aborts_its_uploads(s3: S3Server):  # noqa: F811
    storage = Storage(s3.url("torn-pruned"))
    # Rank 1 finished its file, rank 0 was killed mid-upload: a torn save of step 1.
    storage.fs.pipe_file(storage.path("step-00000001", "__1_0.distcp"), b"rank 1")
    _killed_upload(storage, storage.path("step-00000001", "__0_0.distcp"))
    ckpt = Checkpointer(
        storage, run_id="test", layout="test", async_mode="off", keep_temporary=1, logger=LOG
    )
    ckpt.save(2, {"w": torch.randn(20, 5)}, permanent=False)
    assert ckpt.newest_committed == 2
    assert _open_uploads(storage, "torn-pruned/") == []
    assert not storage.exists(storage.path("step-00000001", "__1_0.distcp"))


OUTAGE_FIELDS = dict(FIELDS, training__steps=10, checkpoint__interval_steps=1)


def _outage_run(run_dir, url: str, gateway: Gateway, *, outage_s: float | None, **fields):
    """Start a 2-rank run saving through `gateway`, cut it once step 2 is logged, restore it
    `outage_s` seconds after the run first reached for the storage while cut (None: never);
    returns the finished process, its stderr and the number of connections the cut refused."""
    proc = start_train(run_dir, "--nproc", "2", **OUTAGE_FIELDS, checkpoint__dir=url, **fields)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 180
    while not (metrics.exists() and any(r.get("step", 0) >= 2 for r in read_metrics(metrics))):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.05)
    gateway.cut()
    if outage_s is not None:
        # Timed from the first refused connection, not from the cut: a save's retry may be
        # asleep in its backoff when the cut begins, and a restore before it wakes tests nothing.
        while gateway.refused == 0:
            alive = proc.poll() is None and time.monotonic() < deadline
            assert alive, proc.communicate()[1][-3000:]
            time.sleep(0.05)
        time.sleep(outage_s)
        gateway.restore()
    _, stderr = proc.communicate(timeout=240)
    return proc, stderr, gateway.refused


def _direct_storage(url: str, monkeypatch) -> Storage:
    """`url` reached directly again, not through the test's gateway."""
    import s3fs

    monkeypatch.undo()
    s3fs.S3FileSystem.clear_instance_cache()  # instances keep the endpoint they were made with
    return Storage(url)


@pytest.mark.slow
def test_short_outage_is_survived(s3: S3Server, tmp_path, monkeypatch):  # noqa: F811
    url = s3.url("short-outage")
    with through_gateway(s3) as (relayed, gateway):
        for key, value in relayed.env.items():
            monkeypatch.setenv(key, value)
        # botocore's own retries (~4-6 s per call here) would only stretch the test; the retry
        # policy under test is distrain's.
        monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
        proc, stderr, refused = _outage_run(
            tmp_path / "run", url, gateway, outage_s=3.0, checkpoint__storage_retry_s=60
        )
    assert proc.returncode == 0, stderr[-3000:]
    assert refused > 0  # the run did reach for the storage while it was cut
    assert "finished 10 steps (newest committed checkpoint: step-00000010)" in stderr
    kept = [e.step for e in committed(_direct_storage(url, monkeypatch))]
    assert kept == [9, 10]  # keep_temporary = 1, and the permanent one at the end


@pytest.mark.slow
def test_long_outage_stops_the_run_with_one_line_naming_the_url(
    s3: S3Server,  # noqa: F811
    tmp_path,
    monkeypatch,
):
    url = s3.url("long-outage")
    with through_gateway(s3) as (relayed, gateway):
        for key, value in relayed.env.items():
            monkeypatch.setenv(key, value)
        monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
        proc, stderr, refused = _outage_run(
            tmp_path / "run",
            url,
            gateway,
            outage_s=None,
            checkpoint__storage_retry_s=1,
            checkpoint__max_failed_saves=2,
        )
    assert proc.returncode != 0 and refused > 0
    errors = [line for line in stderr.splitlines() if line.startswith("distrain: error:")]
    assert errors, stderr[-3000:]
    assert re.fullmatch(
        rf"distrain: error: checkpoint step-\d{{8}} not saved: storage {re.escape(url)} "
        r"unreachable: .+ failed \(.+\) after \d+ attempt\(s\) in [\d.]+ s "
        r"\(checkpoint\.storage_retry_s = 1\); 2 saves in a row failed "
        r"\(checkpoint\.max_failed_saves = 2\), stopping; newest committed checkpoint: "
        # Both ranks stop on it: the console names them once.
        r"step-\d{8}( \(ranks 0, 1: the same error\))?",
        errors[0],
    ), errors[0]
    failed = [
        r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "checkpoint_failed" in r
    ]
    assert len(failed) == 2 and all(url in r["checkpoint_error"] for r in failed)
    newest = committed(_direct_storage(url, monkeypatch))[-1].step
    assert f"newest committed checkpoint: step-{newest:08d}" in errors[0]
