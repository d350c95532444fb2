"""What a run's console shows when something goes wrong: one line per event, the details in
the rank logs. A 2-rank run whose ranks both fail with the same error shows it once, naming
both, and no traceback (the tracebacks are in the rank logs); a 1-process run that checkpoints
and resumes, through the CLI and through the Python API, shows no DCP warning about running
without a process group. (A replica group's kill: tests/test_replica_groups.py.)"""

from __future__ import annotations

import warnings

from helpers import SMALL_RUN, train_cli

import distrain
from distrain.checkpoint.load import NO_GROUP_WARNING

TINY = {
    "data.max_bytes": 200_000,
    "training.log_interval_steps": 1,
    "training.eval_interval_steps": 0,
    "training.global_batch_size": 4,
    "training.micro_batch_size": 2,
    "training.seq_len": 32,
    "metrics.progress_bar": False,
    "metrics.tensorboard": False,
    "checkpoint.interval_steps": 1,
}


def test_ranks_failing_alike_show_one_line_and_no_traceback(tmp_path):
    run = tmp_path / "run"
    result = train_cli(
        run, 2, **SMALL_RUN, training__steps=3, debug__fail_at_step=2, debug__fail_rank=-1
    )
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    # Without a restart to come, torchrun's agent does not say it again (its "failed (exitcode").
    assert "exitcode" not in result.stderr, result.stderr[-3000:]
    (line,) = [x for x in result.stderr.splitlines() if "InjectedFailure" in x]
    assert line.startswith("distrain: error: InjectedFailure: debug.fail_at_step: rank 0 ")
    assert "(ranks 0, 1: the same error; tracebacks in " in line, line
    for rank in (0, 1):
        log = (run / "logs" / f"rank{rank}.log").read_text()
        assert f"InjectedFailure: debug.fail_at_step: rank {rank} crashes at step 2" in log


def _api_run(run_dir, steps: int) -> list[warnings.WarningMessage]:
    """distrain.run_training for `steps` steps (a checkpoint each), the warnings it gave."""
    overrides = {**TINY, "run.dir": str(run_dir), "training.steps": steps}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        distrain.run_training(distrain.load_config(None, overrides=overrides))
    return caught


def test_one_process_checkpoints_warn_of_no_missing_group(tmp_path):
    run = tmp_path / "run"
    caught = _api_run(run, 2) + _api_run(run, 3)  # saves, then a resume's load and a save
    assert (run / "checkpoints" / "step-00000003").is_dir()
    assert not [w for w in caught if NO_GROUP_WARNING in str(w.message)], caught
    result = train_cli(
        tmp_path / "cli", 1, **{k.replace(".", "__"): v for k, v in TINY.items()}, training__steps=2
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert NO_GROUP_WARNING not in result.stderr, result.stderr[-3000:]
