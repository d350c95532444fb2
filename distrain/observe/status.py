"""`distrain status RUN_DIR`: where a run stands — its last metrics, an ETA from the recent step
time, its committed checkpoints (kind, step, whether their files match the manifest's sizes), what
its saves cost (stall, write time, size, failures) and
its restarts and the membership changes of its replica groups — from the run dir alone."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

from distrain.config.io import run_config_file
from distrain.observe.diagnose import checkpoint_folder, parse_rank_log, replica_lines, save_lines


def _checkpoint_lines(folder: Path) -> list[str]:
    lines = []
    for manifest_path in sorted(folder.glob("*/MANIFEST.json")):
        manifest = json.loads(manifest_path.read_text())
        files = manifest.get("files", {})
        intact = all(
            (manifest_path.parent / name).exists()
            and (manifest_path.parent / name).stat().st_size == entry["size"]
            for name, entry in files.items()
        )
        lines.append(
            f"  step {manifest['step']:>8}  {manifest.get('kind', '?'):<10} "
            f"{'sizes match' if intact else 'FILES MISSING OR TRUNCATED'}  {manifest_path.parent}"
        )
    return lines


def status(run_dir: Path) -> str:
    run_dir = Path(run_dir)
    config_path = run_config_file(run_dir)
    config = tomllib.loads(config_path.read_text())
    total = config.get("training", {}).get("steps")
    out = [f"run {run_dir}"]
    metrics = run_dir / "metrics.jsonl"
    rows = []
    if metrics.exists():
        rows = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
    trained = [r for r in rows if "loss" in r]
    if trained:
        last = trained[-1]
        shown = ", ".join(
            f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
            for k, v in last.items()
            if k != "step"
        )
        out.append(f"step {last['step']}/{total}: {shown}")
        if total and "step_time_s" in last and last["step"] < total:
            eta = (total - last["step"]) * last["step_time_s"]
            out.append(f"ETA {eta / 60:.1f} min at {last['step_time_s']:.3f} s/step")
        val = [r for r in rows if "val_loss" in r]
        if val:
            out.append(f"val_loss {val[-1]['val_loss']:.4f} at step {val[-1]['step']}")
    else:
        out.append("no training step logged yet")
    lines = _checkpoint_lines(checkpoint_folder(run_dir))
    out.append(f"checkpoints ({len(lines)} committed):" if lines else "no committed checkpoint")
    out += lines
    out += save_lines(rows)
    log = run_dir / "logs" / "rank0.log"
    attempts = parse_rank_log(log) if log.exists() else []
    out.append(f"restarts: {max(len(attempts) - 1, 0)}")
    out += replica_lines(rows)
    return "\n".join(out)
