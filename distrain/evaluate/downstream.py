"""`distrain eval RUN_DIR --tasks T1,T2`: lm-evaluation-harness tasks on one checkpoint of a run.

The checkpoint (the newest, or --step's; any layout's) is loaded into the plain model as
`distrain export` loads it, wrapped as a `DistrainLM` with the run's tokenizer, and evaluated
by `lm_eval.simple_evaluate`. Tasks come from --include-path (a folder of the harness's task
YAML files, with their local data files) or, without it, the harness's own task list. The
Hugging Face hub is never asked (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE are set): a task's data
must be local files or already in the datasets cache.

Results: <run_dir>/eval/step-NNNNNNNN.json (the harness's per-task results, sample counts and
task versions), a metrics.jsonl row `eval/TASK/METRIC` at the checkpoint's step, and the same
numbers and the JSON file sent to the run's trackers (the tracker run kept in trackers.json).
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any

import torch

from distrain.checkpoint.manifest import step_name
from distrain.config.io import load_config, run_config_file
from distrain.data.tokenizer import load_tokenizer
from distrain.errors import ConfigError, install_hint
from distrain.files import make_dir, write_atomic
from distrain.interop.export import load_run_model
from distrain.models.registry import model_shape
from distrain.observe.logs import LOGGER_NAME
from distrain.observe.metrics import MetricsWriter
from distrain.observe.trackers import Trackers, flat_params

EVAL_DIR = "eval"


def metrics_row(step: int, results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """`eval/TASK/METRIC` for each task's metrics (the harness's "acc,none" is `acc`; another
    filter than none is appended: `exact_match_strict`), stderr and sample counts left out."""
    row: dict[str, Any] = {"step": step}
    for task, metrics in results.items():
        for key, value in metrics.items():
            metric, comma, filt = key.partition(",")
            if (
                not comma
                or "stderr" in metric
                or isinstance(value, bool)
                or not isinstance(value, int | float)
            ):
                continue
            if not math.isfinite(value):
                continue
            name = metric if filt in ("", "none") else f"{metric}_{filt}"
            row[f"eval/{task}/{name}"] = float(value)
    return row


def run_eval(
    run_dir: Path,
    *,
    tasks: list[str],
    step: int | None = None,
    limit: int | None = None,
    include_path: Path | None = None,
    batch_size: int = 16,
    checkpoint_dir: str | None = None,
) -> tuple[Path, dict[str, Any]]:
    """Evaluate the checkpoint; returns the results file and its metrics row."""
    if not tasks:
        raise ConfigError("--tasks: name at least one task (comma-separated)")
    if limit is not None and limit < 1:
        raise ConfigError(f"--limit must be >= 1 (examples per task), got {limit}")
    if batch_size < 1:
        raise ConfigError(f"--batch-size must be >= 1, got {batch_size}")
    if include_path is not None and not include_path.is_dir():
        raise ConfigError(f"--include-path: no such folder {str(include_path)!r}")
    cfg = load_config(str(run_config_file(run_dir)))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    try:
        import lm_eval
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise ConfigError(
            "distrain eval needs lm-evaluation-harness: " + install_hint("lm-eval", "eval")
        ) from None
    from distrain.evaluate.harness import DistrainLM

    manager = TaskManager(
        include_path=str(include_path) if include_path else None,
        include_defaults=include_path is None,
    )
    missing = [t for t in tasks if t not in manager.all_tasks]
    if missing:
        where = f"in {include_path}" if include_path else "in lm-evaluation-harness"
        raise ConfigError(f"--tasks: no task {missing[0]!r} {where}")
    model, step = load_run_model(run_dir, step=step, checkpoint_dir=checkpoint_dir)
    if torch.cuda.is_available():
        model = model.cuda()
    lm = DistrainLM(
        model,
        load_tokenizer(cfg.data.tokenizer),
        max_length=model_shape(cfg.model).max_seq_len,
        batch_size=batch_size,
    )
    out = lm_eval.simple_evaluate(
        model=lm,
        tasks=tasks,
        limit=limit,
        task_manager=manager,
        bootstrap_iters=0,
        log_samples=False,
    )
    results = {
        "step": step,
        "tasks": tasks,
        "limit": limit,
        "results": out["results"],
        "n-samples": out.get("n-samples", {}),
        "versions": out.get("versions", {}),
    }
    path = make_dir(run_dir, EVAL_DIR) / f"{step_name(step)}.json"
    write_atomic(path, json.dumps(results, indent=1, default=str) + "\n")
    row = metrics_row(step, out["results"])
    writer = MetricsWriter(
        Path(run_dir), enabled=True, tensorboard=cfg.metrics.tensorboard, new_attempt=False
    )
    writer.log(row)
    writer.close()
    trackers = Trackers(
        cfg.metrics,
        Path(run_dir),
        logging.getLogger(LOGGER_NAME),
        params=flat_params(cfg.to_dict()),
        total_steps=cfg.training.steps,
    )
    trackers.send_results(row, path)
    return path, row
