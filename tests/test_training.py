"""End-to-end training: layout parity, accumulation, exact resume, crash safety, CLI and errors.

Single-rank references run in this process; multi-rank runs go through `distrain train --nproc N`
(torchrun's agent, gloo), exactly as a user starts them, or where several only need to finish or
crash, through distrain's worker entry in one torchrun launch (tests/batch.py).
"""

import json
import shutil

import pytest
from batch import Batches, Run
from helpers import SMALL_RUN, cli_in_process, losses, run_cli, train_cli, train_in_process

from distrain.checkpoint import checkpointer, manifest
from distrain.checkpoint.storage import Storage
from distrain.observe.metrics import read_metrics
from distrain.train.fault_injection import InjectedFailure

STEPS = 6
# Global batch 8 x 64 tokens: small enough for 2 cores, the same math on any number of ranks.
BASE = {
    "training__steps": STEPS,
    "training__global_batch_size": 8,
    "training__seq_len": 64,
    "checkpoint__interval_steps": 0,
    "checkpoint__at_end": False,
}


def assert_rel_close(got: dict[int, float], want: dict[int, float], rel: float) -> None:
    assert got.keys() == want.keys()
    for step in want:
        assert abs(got[step] - want[step]) <= rel * abs(want[step]), (step, got[step], want[step])


def test_accumulation_matches_one_big_micro_batch(tmp_path):
    big = losses(train_in_process(tmp_path / "big", **BASE, training__micro_batch_size=8))
    accum = losses(train_in_process(tmp_path / "accum", **BASE, training__micro_batch_size=2))
    # 1e-5: 4 micro-batches summed in fp32 vs one batch's reduction; ordering noise only.
    assert_rel_close(accum, big, rel=1e-5)
    assert big[STEPS] < big[1]  # it trains


def test_resume_is_bit_exact_and_skips_torn_saves(tmp_path, monkeypatch):
    fields = dict(BASE, training__micro_batch_size=4, checkpoint__interval_steps=2)
    full = losses(train_in_process(tmp_path / "full", **fields))

    run = tmp_path / "resumed"
    with pytest.raises(InjectedFailure):
        train_in_process(run, **fields, debug__fail_at_step=4)
    assert _committed_steps(run) == [2]

    # A crash between writing step 4's data and its manifest: resume must ignore that save.
    # (A BaseException, as a kill would end the process: an Exception there is a failed save,
    # handled and counted by the checkpointer.)
    class Crash(BaseException):
        pass

    def crash(*_args, **_kwargs):
        raise Crash("simulated crash before the manifest")

    with monkeypatch.context() as patch:
        patch.setattr(checkpointer, "write_manifest", crash)
        with pytest.raises(Crash, match="before the manifest"):
            train_in_process(run, **fields)
    assert (run / "checkpoints" / "step-00000004" / ".metadata").exists()
    assert _committed_steps(run) == [2]

    resumed = losses(train_in_process(run, **fields, run__resume=True))
    assert resumed == full  # bit for bit: same floats, not merely close


def test_corrupted_newest_checkpoint_is_skipped_on_resume(tmp_path, monkeypatch):
    fields = dict(BASE, training__micro_batch_size=4, checkpoint__interval_steps=2)
    faults = dict(debug__corrupt_checkpoint_step=4, debug__fail_at_step=5)
    full = losses(train_in_process(tmp_path / "full", **fields))
    run = tmp_path / "run"
    with pytest.raises(InjectedFailure):
        train_in_process(run, **fields, **faults)
    # The restart torchrun would make (same config): the faults belong to the first attempt,
    # so neither the crash nor the damage to the step-4 checkpoint saved again happens.
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    resumed = losses(train_in_process(run, **fields, **faults))
    log = (run / "logs" / "rank0.log").read_text()
    assert "step-00000004 is damaged" in log and "fails its SHA-256 checksum" in log
    assert "resumed from checkpoint step-00000002" in log
    assert log.count("debug.corrupt_checkpoint_step: damaged") == 1
    assert resumed == full


@pytest.mark.slow
def test_resume_on_two_ranks_is_bit_exact(tmp_path, check_ok):
    # Async saves: the checkpoint is written in the background while training goes on.
    fields = dict(
        BASE,
        training__micro_batch_size=4,
        checkpoint__interval_steps=3,
        checkpoint__async_mode="thread",
    )
    # The uninterrupted run and the crashing one share a torchrun launch (tests/batch.py); the
    # crash ends it, so it comes last.
    runs = {
        "full": Run(2, fields),
        "resumed": Run(2, dict(fields, debug__fail_at_step=5, debug__fail_rank=1)),
    }
    batches = Batches(runs, tmp_path)
    full_run = batches.result("full")
    assert full_run.error is None, full_run.error
    failed = batches.result("resumed")
    assert failed.error is not None
    assert "debug.fail_at_step: rank 1 crashes at step 5" in failed.error, failed.error
    run = failed.run_dir
    check_ok(train_cli(run, 2, **fields))
    full = losses(read_metrics(full_run.run_dir / "metrics.jsonl"))
    assert losses(read_metrics(run / "metrics.jsonl")) == full


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_a_file_damaged_in_a_nonzero_ranks_share_resumes_every_rank_alike(
    tmp_path, check_ok, world
):
    """The newest checkpoint (step 4) of a run that crashed at step 5 has a shard file damaged
    that the last rank alone hashes when the ranks share the verification: every rank skips it
    and resumes step 2, and the steps after it have the uninterrupted run's losses."""
    fields = dict(SMALL_RUN, training__steps=STEPS, checkpoint__interval_steps=2)
    # Ranks that disagree on the checkpoint meet different collectives: fail within a minute.
    fields.update(checkpoint__collective_timeout_s=60, comm__collective_timeout_s=60)
    runs = {
        "full": Run(world, fields),
        "resumed": Run(world, dict(fields, debug__fail_at_step=5, debug__fail_rank=world - 1)),
    }
    batches = Batches(runs, tmp_path)
    full_run = batches.result("full")
    assert full_run.error is None, full_run.error
    failed = batches.result("resumed")
    assert failed.error is not None and "crashes at step 5" in failed.error, failed.error
    run = failed.run_dir
    step4 = run / "checkpoints" / "step-00000004"
    names = sorted(json.loads((step4 / manifest.MANIFEST).read_text())["files"])
    damaged = next(n for n in names[world - 1 :: world] if n.endswith(".distcp"))
    data = bytearray((step4 / damaged).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (step4 / damaged).write_bytes(bytes(data))

    resumed = train_cli(run, world, **fields)
    # Before the exit code: ranks that disagreed fail the run, each having said where it went.
    for rank in range(world):
        log = (run / "logs" / f"rank{rank}.log").read_text()
        assert "step-00000004 is damaged" in log, (rank, log[-2000:])
        assert "resumed from checkpoint step-00000002" in log, (rank, log[-2000:])
    check_ok(resumed)
    full = losses(read_metrics(full_run.run_dir / "metrics.jsonl"))
    assert losses(read_metrics(run / "metrics.jsonl")) == full


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    """One short `distrain train` on 2 ranks with every output on, shared by the CLI tests."""
    run = tmp_path_factory.mktemp("cli") / "run"
    result = train_cli(
        run,
        2,
        **dict(
            BASE,
            checkpoint__interval_steps=3,
            training__eval_interval_steps=3,
            metrics__tensorboard=True,
            metrics__progress_bar=True,
            training__micro_batch_size=4,
        ),
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return run, result


@pytest.mark.slow
def test_cli_writes_the_run_directory(cli_run):
    run, result = cli_run
    assert (run / "config.toml").is_file()
    assert sorted(p.name for p in (run / "logs").iterdir()) == ["rank0.log", "rank1.log"]
    assert any((run / "tb").glob("events.out.tfevents.*"))
    rows = read_metrics(run / "metrics.jsonl")
    step_rows = [r for r in rows if "loss" in r]
    assert [r["step"] for r in step_rows] == list(range(1, STEPS + 1))
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "step_time_s"):
        assert all(r[key] > 0 for r in step_rows), key
    assert [r["step"] for r in rows if "val_loss" in r] == [3, 6]
    assert _committed_steps(run) == [3, 6]
    assert "train: 100%" in result.stderr  # the rank-0 progress bar


@pytest.mark.slow
def test_cli_generate_prints_text(cli_run, check_ok):
    run, _ = cli_run
    result = check_ok(
        run_cli("generate", "--run-dir", str(run), "--prompt", "def ", "--max-new-tokens", "40")
    )
    assert result.stdout.startswith("def ") and len(result.stdout) > 20


@pytest.mark.slow
def test_cli_generate_skips_a_corrupt_checkpoint_and_errors_without_any(cli_run, tmp_path):
    run, _ = cli_run
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    for step in (6, 3):
        shard = next((copy / "checkpoints" / f"step-{step:08d}").glob("*.distcp"))
        shard.write_bytes(b"not a tensor")
        result = run_cli("generate", "--run-dir", str(copy), "--max-new-tokens", "5")
        assert f"step-{step:08d} is damaged" in result.stderr
    assert result.returncode == 1
    assert _error_lines(result) == [
        f"distrain: error: --run-dir {copy}: no complete, intact checkpoint under "
        f"{copy / 'checkpoints'}"
    ]


def _committed_steps(run) -> list[int]:
    return [e.step for e in manifest.committed(Storage(str(run / "checkpoints")))]


def _error_lines(result) -> list[str]:
    """The `distrain: error:` lines, cut at the first parenthesis (the detail after it varies)."""
    return [
        line.split(" (")[0]
        for line in result.stderr.splitlines()
        if line.startswith("distrain: error:")
    ]


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["train", "--training.stepz", "5"], "unknown config field 'training.stepz'"),
        (["train", "--training.steps", "five"], "training.steps: expected int, got 'five'"),
        (
            ["train", "--nproc", "3"],
            "training.global_batch_size (32) must be a multiple of "
            "training.micro_batch_size (8) x data-parallel size (3",
        ),
        (["generate", "--run-dir", "/nonexistent/run"], "/nonexistent/run: not a distrain run"),
        (
            ["train", "--resume", "--run-dir", "/nonexistent/run", "--nproc", "1"],
            "--resume: no complete checkpoint under /nonexistent/run/checkpoints",
        ),
    ],
)
def test_bad_input_is_one_line_error(args, expected, tmp_path, capsys):
    if "--resume" in args:  # a fresh, writable run dir without checkpoints
        args = [str(tmp_path / "fresh") if a == "/nonexistent/run" else a for a in args]
        expected = expected.replace("/nonexistent/run", str(tmp_path / "fresh"))
        # The workers refuse it (the trainer looks for the checkpoint): a real launch.
        result = run_cli(*args)
    else:  # refused before any worker starts: in this process
        result = cli_in_process(capsys, *args)
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.startswith("distrain: error:")]
    assert lines and expected in lines[0], result.stderr[-2000:]
