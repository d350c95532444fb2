"""`distrain diagnose RUN_DIR`: the first failing rank with its traceback, restarts, the last
committed checkpoint; from a real failing run and from a run dir written by hand. And `distrain
status RUN_DIR` on the same failing run."""

from __future__ import annotations

import errno
import json
import re
from pathlib import Path

import pytest
from helpers import cli_in_process, train_cli

from distrain.checkpoint.storage import Storage, StorageError
from distrain.errors import DistrainError
from distrain.observe.diagnose import diagnose
from distrain.observe.logs import close_logging, setup_logging

FIELDS = {
    "training__steps": 4,
    "training__global_batch_size": 4,
    "training__micro_batch_size": 2,
    "training__seq_len": 32,
    "checkpoint__interval_steps": 2,
    "checkpoint__at_end": False,
}


@pytest.mark.slow
def test_diagnose_names_the_worker_that_raised_with_its_traceback(tmp_path, capsys):
    run = tmp_path / "run"
    result = train_cli(run, 2, **FIELDS, debug__fail_at_step=3, debug__fail_rank=1)
    assert result.returncode != 0
    report = cli_in_process(capsys, "diagnose", str(run))
    assert report.returncode == 0, report.stderr
    lines = report.stdout.splitlines()
    first = next(line for line in lines if line.startswith("attempt 0:"))
    assert "rank 1 failed first" in first
    assert "debug.fail_at_step: rank 1 crashes at step 3" in first
    assert "InjectedFailure: debug.fail_at_step: rank 1 crashes at step 3" in report.stdout
    assert "in step_begins" in report.stdout  # a frame of the traceback (train/fault_injection.py)
    assert "last committed checkpoint: step 2 (temporary, world size 2)" in report.stdout

    # distrain status on the same run dir: last metrics, checkpoints checked against their
    # manifest's sizes, then a truncated shard is reported as such.
    shown = cli_in_process(capsys, "status", str(run))
    assert shown.returncode == 0, shown.stderr
    assert "step 2/4: loss " in shown.stdout
    assert "ETA " in shown.stdout
    assert "checkpoints (1 committed):" in shown.stdout
    assert "temporary  sizes match" in shown.stdout
    assert "restarts: 0" in shown.stdout
    shard = next((run / "checkpoints" / "step-00000002").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:10])
    assert "FILES MISSING OR TRUNCATED" in cli_in_process(capsys, "status", str(run)).stdout


def _log(path: Path, lines: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


def test_diagnose_orders_failures_by_time_and_counts_restarts(tmp_path):
    start = "2026-01-01 10:00:00,000 [rank{r}] INFO rank {r}/2 on cpu (gloo)"
    _log(
        tmp_path / "logs" / "rank0.log",
        [
            start.format(r=0),
            "2026-01-01 10:00:05,200 [rank0] ERROR rank 0 failed",
            "Traceback (most recent call last):",
            "RuntimeError: peer went away",
            start.format(r=0).replace("10:00:00", "10:01:00"),
            "2026-01-01 10:02:00,000 [rank0] INFO finished 10 steps (last checkpoint at step 10)",
        ],
    )
    _log(
        tmp_path / "logs" / "rank1.log",
        [
            start.format(r=1),
            "2026-01-01 10:00:05,100 [rank1] ERROR rank 1 failed",
            "Traceback (most recent call last):",
            '  File "x.py", line 3, in f',
            "ValueError: bad batch",
            start.format(r=1).replace("10:00:00", "10:01:00"),
            "2026-01-01 10:02:00,000 [rank1] INFO finished 10 steps (last checkpoint at step 10)",
        ],
    )
    report = diagnose(tmp_path)
    assert "attempt 0: rank 1 failed first (10:00:05.100): rank 1 failed" in report
    assert "ValueError: bad batch" in report
    assert "then errors on ranks 0" in report
    assert "attempt 1: finished" in report
    assert "restarts: 1" in report
    assert "no committed checkpoint" in report


def test_diagnose_refuses_a_folder_without_logs(tmp_path):
    with pytest.raises(
        DistrainError, match="not a distrain run directory .it has no logs/rank<N>.log"
    ):
        diagnose(tmp_path)


def test_diagnose_names_a_damaged_checkpoint_and_skipped_nonfinite_steps(tmp_path):
    start = "2026-01-01 10:0{m}:00,000 [rank0] INFO rank 0/1 on cpu (gloo)"
    _log(
        tmp_path / "logs" / "rank0.log",
        [
            start.format(m=0),
            "2026-01-01 10:00:05,000 [rank0] ERROR rank 0 failed",
            start.format(m=1),
            "2026-01-01 10:01:01,000 [rank0] WARNING checkpoint /x/checkpoints/step-00000006 is "
            "damaged (__0_0.distcp fails its SHA-256 checksum); skipping it for the previous one",
            "2026-01-01 10:02:00,000 [rank0] INFO finished 8 steps",
        ],
    )
    rows = [{"step": s, "loss": 1.0, "nonfinite_skipped": int(s >= 3)} for s in range(1, 5)]
    # After a resume from step 2 the count starts again: step 3 is skipped once more.
    rows += [{"step": s, "loss": 1.0, "nonfinite_skipped": int(s >= 3)} for s in range(3, 6)]
    (tmp_path / "metrics.jsonl").write_text("".join(f"{json.dumps(r)}\n" for r in rows))
    report = diagnose(tmp_path).splitlines()
    assert (
        "attempt 1: resume skipped checkpoint step-00000006 is damaged (__0_0.distcp fails its "
        "SHA-256 checksum)" in report
    )
    assert "attempt 1: finished" in report
    assert "non-finite gradients: update skipped at step(s) 3" in report
    # A run without either says nothing of them.
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 1.0}) + "\n")
    assert not any("non-finite" in line for line in diagnose(tmp_path).splitlines())


def test_diagnose_reports_storage_outages_from_the_retry_warnings(tmp_path):
    """The warnings Storage.call writes to a rank's log, as written (setup_logging's format)."""
    logger = setup_logging(tmp_path, rank=0)
    try:
        logger.info("rank 0/1 on cpu (gloo)")
        storage = Storage("memory://bucket/run", retry_s=10)
        refused = ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused")
        failures = iter([refused, refused])

        def flaky() -> str:
            if error := next(failures, None):
                raise error
            return "ok"

        storage.call("listing memory://bucket/run", flaky)  # ridden out

        def refuse() -> str:
            raise refused

        with pytest.raises(StorageError):  # not ridden out: 0.15 s allows one retry
            Storage("memory://gone", retry_s=0.15).call("reading", refuse)
    finally:
        close_logging(logger)
    report = diagnose(tmp_path).splitlines()
    recovered = [line for line in report if "memory://bucket/run unreachable for" in line]
    assert len(recovered) == 1, report
    seconds = float(re.search(r"for ([\d.]+) s", recovered[0]).group(1))
    assert recovered[0] == (
        f"attempt 0: storage memory://bucket/run unreachable for {seconds:.1f} s (rank 0), "
        "recovered"
    )
    assert 0.3 <= seconds < 5  # backoff 0.1 s, then 0.2 s
    assert "attempt 0: storage memory://gone unreachable (rank 0), not reached again" in report


def test_diagnose_names_a_rank_that_ended_without_an_error(tmp_path):
    """A SIGKILLed rank logs nothing; its peer logs the connection reset: the silent rank is
    named beside the one that failed first, and not when every rank logged its error."""
    start = "2026-01-01 10:00:00,000 [rank{r}] INFO rank {r}/2 on cpu (gloo)"
    _log(tmp_path / "logs" / "rank0.log", [start.format(r=0)])
    _log(
        tmp_path / "logs" / "rank1.log",
        [start.format(r=1), "2026-01-01 10:00:05,100 [rank1] ERROR Connection reset by peer"],
    )
    report = diagnose(tmp_path)
    assert "attempt 0: rank 1 failed first" in report
    assert "  rank 0 ended without an error in its log (killed from outside?)" in report
    _log(
        tmp_path / "logs" / "rank0.log",
        [start.format(r=0), "2026-01-01 10:00:05,200 [rank0] ERROR rank 0 failed"],
    )
    assert "ended without an error" not in diagnose(tmp_path)
