"""Experiment trackers (MLflow, Weights & Biases) behind a bounded queue on a background thread,
so that a slow or unreachable tracker never blocks or fails training.

Rank 0's metrics writer hands every row it writes to each `BackgroundTracker`; the tracker's
thread opens the tracker run (params = the resolved config, flattened, credentials redacted:
observe/redact.py), sends the rows' numbers in batches and, at `close`, the artifacts
(config.toml as redacted, written to <run_dir>/tracked/, a plot of the curves, summary.json;
one that cannot be written, a planted symlink refused, is a warning) and the run's end. A call
that fails is retried with backoff, reconnecting, while new rows queue up; when the queue holds
`metrics.tracker_queue_rows` rows the oldest are dropped. Each outage and each recovery is one
warning line. `close` waits at most `metrics.tracker_close_timeout_s`, then gives up on what is
left.

The tracker run's id is kept in <run_dir>/trackers.json, so a resumed (or restarted) run
continues the same tracker run; `distrain eval` logs its results there too. The tracker
libraries are imported on the tracker's thread, when it first connects (mlflow_tracker.py,
wandb_tracker.py).
"""

from __future__ import annotations

import collections
import importlib.util
import json
import logging
import math
import threading
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import tomli_w

from distrain.config.schema import MetricsConfig
from distrain.errors import ConfigError, install_hint
from distrain.files import make_dir, write_atomic
from distrain.observe.observer import Row
from distrain.observe.redact import redacted

IDS_FILE = "trackers.json"
SUMMARY_FILE = "summary.json"
PLOT_DIR, PLOT_FILE = "plots", "metrics.png"
TRACKED_DIR = "tracked"
"""Where the config the trackers get (credentials redacted) is written for them."""
NOT_METRICS = ("step", "attempt", "resumed_from")
BATCH_ROWS = 50
"""Rows sent in one call (MLflow takes up to 1,000 metrics per batch)."""
RETRY_FIRST_S, RETRY_MAX_S = 0.5, 10.0


class TrackerBackend(Protocol):
    """One tracker's client: every method may raise (the server is down, say); the caller
    retries it. Called from the tracker's thread only."""

    name: str

    def open(self, *, run_id: str | None, params: dict[str, str]) -> str:
        """Start (run_id None) or continue the tracker run; returns its id."""

    def log_rows(self, rows: list[tuple[int, float, dict[str, float]]]) -> None:
        """(step, wall time in seconds, metrics) of several rows, in order."""

    def log_artifact(self, path: Path, *, folder: str) -> None: ...

    def finish(self, *, completed: bool | None) -> None:
        """End the tracker run: completed = training reached its last step; None = leave the
        run's status as it is (an evaluation after training)."""


def flat_params(config: dict[str, Any]) -> dict[str, str]:
    """A config, as `Config.to_dict` gives it, as `section.field -> text` (nested
    sections dotted; lists as JSON), credentials redacted (observe/redact.py)."""
    flat: dict[str, str] = {}

    def walk(prefix: str, node: Any) -> None:
        for key, value in node.items():
            name = f"{prefix}.{key}" if prefix else key
            if isinstance(value, dict):
                walk(name, value)
            else:
                flat[name] = json.dumps(value) if isinstance(value, list) else str(value)

    walk("", redacted(config))
    return flat


def metrics_of(row: Row) -> dict[str, float]:
    """A row's finite numbers (no bools, strings or the step counters)."""
    return {
        key: float(value)
        for key, value in row.items()
        if key not in NOT_METRICS
        and isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
    }


def read_ids(run_dir: Path) -> dict[str, str]:
    """tracker name -> run id, as kept in <run_dir>/trackers.json ({} when there is none)."""
    path = Path(run_dir) / IDS_FILE
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: v for k, v in data.items() if isinstance(k, str) and isinstance(v, str)}


def _write_id(run_dir: Path, name: str, run_id: str) -> None:
    ids = {**read_ids(run_dir), name: run_id}
    write_atomic(Path(run_dir) / IDS_FILE, json.dumps(ids, indent=1) + "\n")


@dataclass
class _Outage:
    since: float | None = None
    dropped: int = 0
    failures: int = 0


@dataclass
class _Pending:
    rows: collections.deque = field(default_factory=collections.deque)
    artifacts: list[tuple[Path, str]] = field(default_factory=list)
    finish: bool = False
    """Whether the run's end is asked for (once close is called)."""
    completed: bool | None = None


class BackgroundTracker:
    """One tracker run fed from a bounded queue by a daemon thread (see the module docstring)."""

    def __init__(
        self,
        backend: TrackerBackend,
        *,
        run_dir: Path,
        params: dict[str, str],
        max_rows: int,
        logger: logging.Logger,
    ):
        self.backend = backend
        self.run_dir = Path(run_dir)
        self.params = params
        self.max_rows = max_rows
        self.log = logger
        self.run_id: str | None = read_ids(run_dir).get(backend.name)
        self.opened = False
        self._pending = _Pending()
        self._cv = threading.Condition()
        self._closing = False
        self._abandoned = False
        self._outage = _Outage()
        self._thread = threading.Thread(
            target=self._work, name=f"tracker-{backend.name}", daemon=True
        )
        self._thread.start()

    # --- the training side: never blocks on the tracker --------------------------------------

    def log_row(self, row: Row) -> None:
        numbers = metrics_of(row)
        if not numbers or "step" not in row:
            return
        with self._cv:
            rows = self._pending.rows
            if len(rows) >= self.max_rows:
                rows.popleft()
                self._outage.dropped += 1
                if self._outage.dropped == 1:
                    self.log.warning(
                        "tracker %s: %d rows waiting (metrics.tracker_queue_rows); dropping the "
                        "oldest while it does not keep up",
                        self.backend.name,
                        self.max_rows,
                    )
            rows.append((int(row["step"]), time.time(), numbers))
            self._cv.notify()

    def close(
        self, *, artifacts: list[tuple[Path, str]], completed: bool | None, timeout_s: float
    ) -> None:
        """Send what is queued, then `artifacts` ((file, folder in the tracker run)) and the
        run's end; wait at most timeout_s for it."""
        with self._cv:
            self._pending.artifacts += [(p, f) for p, f in artifacts if Path(p).is_file()]
            self._pending.finish = True
            self._pending.completed = completed
            self._closing = True
            self._cv.notify()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            with self._cv:
                left = len(self._pending.rows)
                self._pending.rows.clear()
                self._pending.artifacts.clear()
                self._pending.finish = False
                self._abandoned = True
                self._cv.notify()
            self.log.warning(
                "tracker %s: not reached within metrics.tracker_close_timeout_s (%gs); giving up "
                "on %d rows, the artifacts and the run's end",
                self.backend.name,
                timeout_s,
                left,
            )

    # --- the tracker's thread ----------------------------------------------------------------

    def _next(self) -> tuple[str, Any] | None:
        """What to send next (None: the run's end was sent, or abandoned)."""
        with self._cv:
            while True:
                p = self._pending
                if self._abandoned:
                    return None
                if not self.opened:
                    return ("open", None)
                if p.rows:
                    return ("rows", [p.rows[i] for i in range(min(BATCH_ROWS, len(p.rows)))])
                if p.artifacts:
                    return ("artifact", p.artifacts[0])
                if p.finish:
                    return ("finish", p.completed)
                if self._closing:
                    return None
                self._cv.wait()

    def _done(self, kind: str, value: Any) -> None:
        with self._cv:
            if kind == "rows":
                for _ in range(min(len(value), len(self._pending.rows))):
                    self._pending.rows.popleft()
            elif kind == "artifact" and self._pending.artifacts:
                self._pending.artifacts.pop(0)
            elif kind == "finish":
                self._pending.finish = False
                self._closing = True

    def _work(self) -> None:
        delay = RETRY_FIRST_S
        while (item := self._next()) is not None:
            kind, value = item
            try:
                if kind == "open":
                    self.run_id = self.backend.open(run_id=self.run_id, params=self.params)
                    _write_id(self.run_dir, self.backend.name, self.run_id)
                    self.opened = True
                elif kind == "rows":
                    self.backend.log_rows(value)
                elif kind == "artifact":
                    self.backend.log_artifact(value[0], folder=value[1])
                else:
                    self.backend.finish(completed=value)
            except Exception as e:  # a tracker's failure is never the run's
                self._failed(kind, e)
                with self._cv:
                    self._cv.wait(delay)
                delay = min(delay * 2, RETRY_MAX_S)
                continue
            self._done(kind, value)
            delay = RETRY_FIRST_S
            self._recovered()

    def _failed(self, kind: str, error: Exception) -> None:
        outage = self._outage
        outage.failures += 1
        if outage.since is None:
            outage.since = time.monotonic()
            self.log.warning(
                "tracker %s: %s failed (%s: %s); training goes on, retrying in the background",
                self.backend.name,
                kind,
                type(error).__name__,
                str(error).splitlines()[0][:200] if str(error) else "",
            )

    def _recovered(self) -> None:
        outage = self._outage
        if outage.since is None:
            return
        self.log.warning(
            "tracker %s: reachable again after %.1fs (%d failed calls, %d rows dropped)",
            self.backend.name,
            time.monotonic() - outage.since,
            outage.failures,
            outage.dropped,
        )
        self._outage = _Outage()


def check_trackers_installed(metrics: MetricsConfig) -> None:
    """One line naming the field and the fix when a configured tracker's library is missing."""
    wanted = []
    if metrics.mlflow.tracking_uri:
        wanted.append(("metrics.mlflow.tracking_uri", "mlflow"))
    if metrics.wandb.mode != "disabled":
        wanted.append(("metrics.wandb.mode", "wandb"))
    for name, package in wanted:
        if importlib.util.find_spec(package) is None:
            raise ConfigError(
                f"{name} is set but the {package} package is not installed; "
                f"{install_hint(package, 'track')}, or unset {name}"
            )


class Trackers:
    """The trackers `metrics` asks for, as one sink of rank 0's metrics writer: each row to
    every tracker, which records the run's `params` (`flat_params`); at the end summary.json
    (the last value of every metric and the step it was logged at) and a plot of the curves,
    sent with config.toml as the run's artifacts. `total_steps`: training.steps (a run that
    reached it is marked completed)."""

    def __init__(
        self,
        metrics: MetricsConfig,
        run_dir: Path,
        logger: logging.Logger,
        *,
        params: dict[str, str],
        total_steps: int,
    ):
        self.run_dir = Path(run_dir)
        self.total_steps = total_steps
        self.timeout_s = metrics.tracker_close_timeout_s
        self.log = logger
        self.summary: dict[str, Any] = {}
        self.last_step = 0
        self.trackers = [
            BackgroundTracker(
                backend,
                run_dir=self.run_dir,
                params=params,
                max_rows=metrics.tracker_queue_rows,
                logger=logger,
            )
            for backend in _backends(metrics, self.run_dir)
        ]

    def __bool__(self) -> bool:
        return bool(self.trackers)

    def log_row(self, row: Row) -> None:
        numbers = metrics_of(row)
        if "step" in row and numbers:
            self.last_step = max(self.last_step, int(row["step"]))
            self.summary.update(
                {key: {"value": v, "step": row["step"]} for key, v in numbers.items()}
            )
        for tracker in self.trackers:
            tracker.log_row(row)

    def send_results(self, row: Row, path: Path) -> None:
        """An evaluation's row and results file to each tracker run, which stays as training
        left it (finished or running); waits at most metrics.tracker_close_timeout_s."""
        deadline = time.monotonic() + self.timeout_s
        for tracker in self.trackers:
            tracker.log_row(row)
            tracker.close(
                artifacts=[(path, path.parent.name)],
                completed=None,
                timeout_s=max(0.0, deadline - time.monotonic()),
            )

    def close(self) -> None:
        if not self.trackers:
            return
        artifacts = []
        for name, write in (
            ("config.toml", self._write_config),
            (SUMMARY_FILE, self._write_summary),
            (f"{PLOT_DIR}/{PLOT_FILE}", self._write_plot),
        ):
            try:
                artifacts.append(write())
            except Exception as e:  # an artifact is a convenience, never the run's failure
                self.log.warning("trackers: no %s artifact (%s)", name, e)
        deadline = time.monotonic() + self.timeout_s
        for tracker in self.trackers:
            tracker.close(
                artifacts=artifacts,
                completed=self.last_step >= self.total_steps,
                timeout_s=max(0.0, deadline - time.monotonic()),
            )

    def _write_config(self) -> tuple[Path, str]:
        """The run's config.toml as the trackers may see it (credentials redacted), under its
        usual name, in <run_dir>/tracked/."""
        config = tomllib.loads((self.run_dir / "config.toml").read_text())
        path = make_dir(self.run_dir, TRACKED_DIR) / "config.toml"
        write_atomic(path, tomli_w.dumps(redacted(config)))
        return path, ""

    def _write_summary(self) -> tuple[Path, str]:
        path = self.run_dir / SUMMARY_FILE
        write_atomic(path, json.dumps({"step": self.last_step, "last": self.summary}, indent=1))
        return path, ""

    def _write_plot(self) -> tuple[Path, str]:
        from distrain.observe.plots import write_plot

        return write_plot([self.run_dir], make_dir(self.run_dir, PLOT_DIR) / PLOT_FILE), PLOT_DIR


def _backends(m: MetricsConfig, run_dir: Path) -> list[TrackerBackend]:
    name = run_dir.resolve().name
    backends: list[TrackerBackend] = []
    if m.mlflow.tracking_uri:
        from distrain.observe.mlflow_tracker import MlflowBackend

        backends.append(MlflowBackend(m.mlflow, default_name=name))
    if m.wandb.mode != "disabled":
        from distrain.observe.wandb_tracker import WandbBackend

        backends.append(WandbBackend(m.wandb, run_dir=run_dir, default_name=name))
    return backends
