"""The Weights & Biases client behind a `BackgroundTracker` (trackers.py): a run in
metrics.wandb.project, online or offline (metrics.wandb.mode), continued by id on resume.

Metrics are logged against their own `step` key (`define_metric`), not W&B's internal step, so
a resumed run that redoes steps since its checkpoint is accepted. W&B's console capture and
system-metrics sampling are off: the training process's output and CPU stay its own. `wandb`
is imported when the tracker first connects. Files (the config, the summary, the plots) are
copied into the W&B run's own folder and saved from there."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from distrain.config.schema import WandbConfig
from distrain.files import write_atomic


class WandbBackend:
    name = "wandb"

    def __init__(self, cfg: WandbConfig, *, run_dir: Path, default_name: str):
        self.cfg = cfg
        self.dir = Path(cfg.dir) if cfg.dir else run_dir
        self.run_name = cfg.run_name or default_name
        self.run: Any = None

    def open(self, *, run_id: str | None, params: dict[str, str]) -> str:
        import wandb

        if self.run is None:
            self.dir.mkdir(parents=True, exist_ok=True)
            self.run = wandb.init(
                project=self.cfg.project,
                entity=self.cfg.entity or None,
                dir=str(self.dir),
                name=self.run_name,
                id=run_id,
                resume="allow" if run_id else None,
                mode=self.cfg.mode,
                config=params,
                allow_val_change=True,
                # No system metadata: it records the command line, which can hold
                # credentials (the config it carries goes through observe/redact.py).
                settings=wandb.Settings(
                    console="off", x_disable_stats=True, x_disable_meta=True, silent=True
                ),
            )
            self.run.define_metric("step")
            self.run.define_metric("*", step_metric="step")
        return self.run.id

    def log_rows(self, rows: list[tuple[int, float, dict[str, float]]]) -> None:
        for step, _, numbers in rows:
            self.run.log({**numbers, "step": step})

    def log_artifact(self, path: Path, *, folder: str) -> None:
        """A copy of `path` in the W&B run's files (under `folder`), uploaded now: saved from
        there, W&B neither symlinks it (with a warning per file) nor sees later changes."""
        files = Path(self.run.dir)
        copy = files / folder / path.name
        copy.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(copy, path.read_bytes())
        self.run.save(str(copy), base_path=str(files), policy="now")

    def finish(self, *, completed: bool | None) -> None:
        self.run.finish(exit_code=0 if completed is not False else 1)
