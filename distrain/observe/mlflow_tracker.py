"""The MLflow client behind a `BackgroundTracker` (trackers.py): a run in
metrics.mlflow.experiment at metrics.mlflow.tracking_uri, continued by id on resume.

MLflow's HTTP client retries a failed request for minutes by itself; here each call fails fast
(one try, a short timeout, unless MLFLOW_HTTP_REQUEST_MAX_RETRIES / _TIMEOUT say otherwise)
and the tracker's thread does the retrying, so rows keep queueing while the server is away.
`mlflow` is imported when the tracker first connects."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from distrain.config.schema import MLflowConfig

PARAMS_PER_CALL = 100  # MLflow's log_batch limit
PARAM_VALUE_CHARS = 6000


class MlflowBackend:
    name = "mlflow"

    def __init__(self, cfg: MLflowConfig, *, default_name: str):
        self.cfg = cfg
        self.run_name = cfg.run_name or default_name
        self.client: Any = None
        self.run_id: str | None = None
        self.status_before = "RUNNING"
        """The run's status when this client continued it."""

    def _connect(self) -> Any:
        if self.client is None:
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
            from mlflow import MlflowClient

            self.client = MlflowClient(tracking_uri=self.cfg.tracking_uri)
        return self.client

    def open(self, *, run_id: str | None, params: dict[str, str]) -> str:
        from mlflow.entities import Param

        client = self._connect()
        logged: dict[str, str] = {}
        run = None
        if run_id is not None:
            try:
                run = client.get_run(run_id)
            except Exception as e:
                if "RESOURCE_DOES_NOT_EXIST" not in str(e):
                    raise
        if run is None:
            experiment = client.get_experiment_by_name(self.cfg.experiment)
            experiment_id = (
                experiment.experiment_id
                if experiment is not None
                else client.create_experiment(self.cfg.experiment)
            )
            run = client.create_run(experiment_id, run_name=self.run_name)
        else:
            logged = dict(run.data.params)
            self.status_before = run.info.status
            client.update_run(run.info.run_id, status="RUNNING")
        self.run_id = run.info.run_id
        # Params are immutable in MLflow: a resumed run adds only the ones it did not have.
        new = [
            Param(key, value[:PARAM_VALUE_CHARS])
            for key, value in params.items()
            if key not in logged
        ]
        for i in range(0, len(new), PARAMS_PER_CALL):
            client.log_batch(self.run_id, params=new[i : i + PARAMS_PER_CALL])
        return self.run_id

    def log_rows(self, rows: list[tuple[int, float, dict[str, float]]]) -> None:
        from mlflow.entities import Metric

        metrics = [
            Metric(key, value, int(wall * 1000), step)
            for step, wall, numbers in rows
            for key, value in numbers.items()
        ]
        for i in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[i : i + 1000])

    def log_artifact(self, path: Path, *, folder: str) -> None:
        self.client.log_artifact(self.run_id, str(path), artifact_path=folder or None)

    def finish(self, *, completed: bool | None) -> None:
        if completed is not None:
            self.client.set_terminated(self.run_id, status="FINISHED" if completed else "KILLED")
        elif self.status_before != "RUNNING":  # back to what training left
            self.client.set_terminated(self.run_id, status=self.status_before)
