"""Checkpoints on an object store: a 2-rank run saves, lists, prunes and resumes through
`s3://` URLs on a real S3-compatible server (tests/s3.py), and continues bit for bit."""

import fsspec
import pytest
from helpers import losses, train_cli
from s3 import S3Server, expected_kind, s3  # noqa: F401  (s3: the module-scoped fixture)

from distrain.checkpoint import committed
from distrain.observe.metrics import read_metrics
from distrain.storage import Storage

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
    check_ok(train_cli(tmp_path / "local", 2, **FIELDS))
    url = s3.url("run/checkpoints")
    crashed = train_cli(tmp_path / "s3", 2, **FIELDS, checkpoint__dir=url, debug__fail_at_step=5)
    assert crashed.returncode != 0
    storage = Storage(url)
    assert [e.step for e in committed(storage)] == [4]  # step 2 pruned (keep_temporary = 1)
    result = check_ok(train_cli(tmp_path / "s3", 2, **FIELDS, checkpoint__dir=url))
    assert "resumed from checkpoint step-00000004" in result.stderr
    entries = committed(Storage(url))
    assert [(e.step, e.permanent) for e in entries] == [(4, False), (6, True)]
    fs, root = fsspec.url_to_fs(url)
    assert fs.exists(f"{root}/step-00000006/MANIFEST.json")
    want = losses(read_metrics(tmp_path / "local" / "metrics.jsonl"))
    assert losses(read_metrics(tmp_path / "s3" / "metrics.jsonl")) == want
