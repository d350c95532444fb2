"""Experiment trackers against the real thing: an MLflow tracking server started here (`mlflow
server`, SQLite store, a local artifact folder, a port the kernel picks) read back through
`mlflow.MlflowClient`, and W&B in offline mode read back from the run file it writes
(tests/wandb_offline.py). One-rank runs in this process: the trackers live on rank 0 only.

The server is killed (SIGKILL to its process group, from outside the training) in the middle
of a run and started again on the same store: training goes on with the same losses as a run
without a tracker, and the tracker sends what it queued meanwhile once the server is back."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import free_port, losses, train_in_process, val_losses
from wandb_offline import read_run

from distrain.observe.metrics import read_metrics
from distrain.observe.trackers import read_ids

mlflow = pytest.importorskip("mlflow")

STEPS = 8
FIELDS = {
    "training__steps": STEPS,
    "training__global_batch_size": 8,
    "training__micro_batch_size": 8,
    "training__seq_len": 64,
    "training__eval_interval_steps": 4,
    "checkpoint__interval_steps": 4,
}
STARTUP_TIMEOUT_S = 120.0


class MlflowServer:
    """`mlflow server` on 127.0.0.1:port over a SQLite file; stop() kills it, start() brings
    it back on the same store and port."""

    def __init__(self, root: Path):
        self.root = root
        self.port = free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        mlflow_cli = Path(sys.executable).with_name("mlflow")
        # Without the job runner: a third process (huey's consumer, importing mlflow again)
        # that no test uses, competing for CI's 2 cores with each start of the server.
        env = dict(os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false")
        self.proc = subprocess.Popen(
            [str(mlflow_cli), "server", "--host", "127.0.0.1", "--port", str(self.port),
             "--workers", "1", "--backend-store-uri", f"sqlite:///{self.root / 'mlflow.db'}",
             "--artifacts-destination", str(self.root / "artifacts")],
            stdout=subprocess.DEVNULL, stderr=open(self.root / "server.log", "ab"),
            start_new_session=True, env=env,
        )  # fmt: skip

    def wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, (self.root / "server.log").read_text()[-3000:]
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            time.sleep(0.1)
        raise TimeoutError(f"mlflow server not ready in {STARTUP_TIMEOUT_S}s")

    def kill(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


@pytest.fixture(scope="module", autouse=True)
def starting_server(tmp_path_factory) -> Iterator[MlflowServer]:
    """The module's server, started when the module begins and not waited for: its start (two
    interpreters importing mlflow, the store's migrations: ~15 s on CI's 2 cores) overlaps the
    reference run and the W&B test, which come first."""
    s = MlflowServer(tmp_path_factory.mktemp("mlflow"))
    s.start()
    yield s
    if s.proc.poll() is None:
        s.kill()


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, float]:
    """The loss curve of the same run without any tracker."""
    return losses(train_in_process(tmp_path_factory.mktemp("ref") / "run", **FIELDS))


@pytest.fixture(scope="module")
def server(starting_server) -> MlflowServer:
    """The server, ready."""
    starting_server.wait_ready()
    return starting_server


def _history(client, run_id: str, key: str) -> dict[int, float]:
    """step -> value; the last one logged for a step (a resumed attempt's) wins."""
    points = sorted(client.get_metric_history(run_id, key), key=lambda m: m.timestamp)
    return {m.step: m.value for m in points}


def test_wandb_offline_run_holds_config_history_and_files_and_resumes(reference, tmp_path, capfd):
    pytest.importorskip("wandb")
    run = tmp_path / "run"
    fields = dict(FIELDS, metrics__wandb__mode="offline", metrics__wandb__project="tracking")
    with pytest.raises(Exception, match="debug.fail_at_step"):
        train_in_process(run, **fields, debug__fail_at_step=6)
    run_id = read_ids(run)["wandb"]
    time.sleep(1.1)  # W&B names an offline run's folder by its start second: one per attempt
    rows = train_in_process(run, **fields)
    assert read_ids(run)["wandb"] == run_id
    files = sorted((run / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))
    assert len(files) == 2  # one per attempt, the same run id: `wandb sync` joins them
    first, second = (read_run(f) for f in files)
    assert first["run_id"] == second["run_id"] == run_id
    assert (first["exit_code"], second["exit_code"]) == (1, 0)
    assert second["config"]["training.steps"] == str(STEPS)
    history = {h["step"]: h["loss"] for h in first["history"] + second["history"] if "loss" in h}
    assert history == losses(rows) == pytest.approx(reference)
    val = [h for h in second["history"] if "val_loss" in h]
    # (The run's last row is its final checkpoint's cost, after the validation row.)
    assert [h["step"] for h in val] == [8] and val[0]["val_loss"] == val_losses(rows)[8]
    assert {"config.toml", "summary.json", "plots/metrics.png"} <= set(second["files"])
    # Copies in W&B's run folder, saved from there: no symlink, nor W&B's warning about one.
    saved = sorted((run / "wandb").glob(f"offline-run-*-{run_id}/files/summary.json"))[-1]
    assert saved.is_file() and not saved.is_symlink()
    assert "Symlinked" not in capfd.readouterr().err


def test_mlflow_run_logs_config_metrics_artifacts_and_resumes_the_same_run(
    server, reference, tmp_path
):
    run = tmp_path / "run"
    fields = dict(FIELDS, metrics__mlflow__tracking_uri=server.uri)
    fields["metrics__mlflow__experiment"] = "tracking-test"
    with pytest.raises(Exception, match="debug.fail_at_step"):
        train_in_process(run, **fields, debug__fail_at_step=6)
    first_id = read_ids(run)["mlflow"]
    client = mlflow.MlflowClient(server.uri)
    assert client.get_run(first_id).info.status == "KILLED"
    rows = train_in_process(run, **fields)  # resumes from step 4
    assert read_ids(run)["mlflow"] == first_id
    got = client.get_run(first_id)
    assert got.info.status == "FINISHED"
    assert client.get_experiment(got.info.experiment_id).name == "tracking-test"
    assert got.info.run_name == "run"
    params = got.data.params
    assert params["training.steps"] == str(STEPS) and params["model.preset"] == "tiny"
    assert params["metrics.mlflow.tracking_uri"] == server.uri
    # Every logged step, the resumed attempt's values replacing the first one's, equal to the
    # metrics file and to the run without a tracker.
    assert _history(client, first_id, "loss") == losses(rows) == pytest.approx(reference)
    val = {r["step"]: r["val_loss"] for r in rows if "val_loss" in r}
    assert _history(client, first_id, "val_loss") == val and set(val) == {4, 8}
    assert _history(client, first_id, "val_ppl")[8] == pytest.approx(2.718281828 ** val[8])
    artifacts = {a.path for a in client.list_artifacts(first_id)}
    assert {"config.toml", "summary.json", "plots"} <= artifacts
    assert [a.path for a in client.list_artifacts(first_id, "plots")] == ["plots/metrics.png"]
    local = Path(client.download_artifacts(first_id, "config.toml", str(tmp_path)))
    assert local.read_text() == (run / "config.toml").read_text()


def test_training_outlives_a_killed_tracking_server(server, reference, tmp_path):
    """SIGKILL to the server after step 2, started again at once: the steps go on meanwhile,
    the run's losses are the tracker-free run's, and the rows queued during the outage reach
    the server when it is back (within metrics.tracker_close_timeout_s at the end)."""
    run = tmp_path / "run"
    killed = threading.Event()

    def kill_after_step_2() -> None:
        metrics = run / "metrics.jsonl"
        while not killed.is_set():
            if metrics.is_file() and any(r.get("step", 0) >= 2 for r in read_metrics(metrics)):
                server.kill()
                killed.set()
                server.start()
                return
            time.sleep(0.02)

    watcher = threading.Thread(target=kill_after_step_2, daemon=True)
    watcher.start()
    try:
        rows = train_in_process(
            run,
            **FIELDS,
            metrics__mlflow__tracking_uri=server.uri,
            metrics__tracker_close_timeout_s=STARTUP_TIMEOUT_S,
            # Steps long enough that the outage falls inside the run, not after it.
            debug__slow_rank=0,
            debug__slow_ms=300,
        )
    finally:
        killed.set()
        watcher.join()
    server.wait_ready()
    assert losses(rows) == pytest.approx(reference)
    log = (run / "logs" / "rank0.log").read_text()
    assert "tracker mlflow:" in log and "failed" in log, log[-3000:]
    assert "reachable again" in log, log[-3000:]
    client = mlflow.MlflowClient(server.uri)
    run_id = read_ids(run)["mlflow"]
    assert _history(client, run_id, "loss") == losses(rows)
    assert client.get_run(run_id).info.status == "FINISHED"


def test_a_missing_tracker_library_is_refused_before_launch(monkeypatch):
    from distrain.config.io import load_config
    from distrain.errors import ConfigError
    from distrain.launch.preflight import preflight

    monkeypatch.setitem(sys.modules, "mlflow", None)  # as if it were not installed
    cfg = load_config(None, [("metrics.mlflow.tracking_uri", "http://127.0.0.1:1")])
    with pytest.raises(ConfigError) as info:
        preflight(cfg)
    assert str(info.value) == (
        "metrics.mlflow.tracking_uri is set but the mlflow package is not installed; pip "
        'install mlflow (or distrain\'s track extra: pip install -e ".[track]" in a checkout), '
        "or unset metrics.mlflow.tracking_uri"
    )


def test_the_package_and_cli_help_import_no_tracker_or_harness():
    code = (
        "import sys, distrain.cli, distrain.train.build, distrain.observe.trackers; "
        "print(sorted(m for m in ('mlflow', 'wandb', 'lm_eval') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_no_credential_reaches_a_tracker(server, tmp_path, monkeypatch):
    """A tracking URI with a password in it and a secret-named field, both on the command line
    too (as `distrain train` has them): no MLflow param or tag, nothing the server stores (its
    database, its artifact folder, its log) and no file of the W&B run holds either; the params
    and the config.toml artifact show them as `***`, and the run's own config.toml keeps them
    (a resume needs them)."""
    password, secret_path = "s3cr3t-pw-81", "/run/keys/TOPSECRET-77"
    run = tmp_path / "run"
    uri = server.uri.replace("http://", f"http://alice:{password}@")
    argv = [f"--metrics.mlflow.tracking_uri={uri}", f"--fault_tolerance.secret_file={secret_path}"]
    monkeypatch.setattr(sys, "argv", ["distrain", "train", *argv])
    train_in_process(
        run,
        **dict(FIELDS, training__steps=2, checkpoint__interval_steps=0),
        metrics__mlflow__tracking_uri=uri,
        metrics__mlflow__experiment="redaction",
        metrics__wandb__mode="offline",
        metrics__wandb__project="redaction",
        fault_tolerance__secret_file=secret_path,
    )
    local = (run / "config.toml").read_text()
    assert uri in local and secret_path in local
    client = mlflow.MlflowClient(server.uri)
    got = client.get_run(read_ids(run)["mlflow"])
    assert got.data.params["metrics.mlflow.tracking_uri"] == server.uri.replace(
        "http://", "http://***@"
    )
    assert got.data.params["fault_tolerance.secret_file"] == "***"
    told = [*got.data.params.values(), *got.data.tags.values()]
    assert not [v for v in told if password in v or secret_path in v]
    shared = Path(client.download_artifacts(got.info.run_id, "config.toml", str(tmp_path)))
    assert 'secret_file = "***"' in shared.read_text()
    assert shared.read_text() == (run / "tracked" / "config.toml").read_text()
    wandb_files = [p for p in (run / "wandb").rglob("*") if p.is_file()]
    assert any(p.suffix == ".wandb" for p in wandb_files)
    (wandb_run,) = (p for p in wandb_files if p.suffix == ".wandb")
    config = read_run(wandb_run)["config"]
    assert config["fault_tolerance.secret_file"] == "***"
    assert config["metrics.mlflow.tracking_uri"] == got.data.params["metrics.mlflow.tracking_uri"]
    sent = [shared, *server.root.rglob("*"), *wandb_files]
    for path in (p for p in sent if p.is_file()):
        data = path.read_bytes()
        assert password.encode() not in data and secret_path.encode() not in data, path
