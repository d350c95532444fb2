"""Many small multi-process training runs in few torchrun launches: one per world size.

Each launch costs CI the import of torch in every process and a rendezvous (~10 s of CPU on 2
ranks, more on 4 and 8) before any training, so a test file of many short runs (the parity
matrix) pays that once per world size instead of once per run. The runs stay separate where it
matters: each has its own run dir, config, process group and pytest case; the launcher-side
checks of `distrain train` (layout rules, preflight) run here for each; a run that fails is
reported under its own name, and the runs after it go on in a new launch.

`pool` gathers the runs of every test module of a session into one `Batches` (the
`batch_pool` fixture of tests/conftest.py): a launch per world size for the whole session, not
per module (~20 s of CPU saved per 2-rank launch, more on 4 and 8).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from types import ModuleType

from helpers import overrides

from distrain.config.args import parse_train_args
from distrain.errors import DistrainError
from distrain.launch.preflight import preflight
from distrain.launch.torchrun import worker_threads
from distrain.layout.rules import validate

WORKER = Path(__file__).with_name("batch_worker.py")
# What `run_cli` allows one run, per run of a launch.
TIMEOUT_PER_RUN_S = 240


@dataclass(frozen=True)
class Run:
    nproc: int
    fields: dict
    """section__field=value overrides on top of helpers.FAST, as for `train_cli`."""
    fails: bool = False
    """A run that fails on purpose: its failure ends its launch, so a pool starts it after the
    runs of its world size that finish."""
    starts_from: tuple[str, int] | None = None
    """(name of another run of the same module, step): this run starts from that run's
    checkpoint of that step (checkpoint.resume_from), so the pool has that run's world size,
    another one, launched first."""


@dataclass(frozen=True)
class Outcome:
    run_dir: Path
    error: str | None
    """None when every rank finished the run; else why not (the worker's traceback, or the
    launch's stderr)."""
    log: Path | None = None
    """The whole output of the launch that ran it (every rank's stdout and stderr), where one
    did."""


def selected(runs: dict[str, Run], items: list) -> dict[str, Run]:
    """The runs that this session's tests need: a run is named after its test case (the item's
    name), or after it and a role in that test (`case:role`, for a test of several runs)."""
    names = {item.name for item in items}
    return {name: run for name, run in runs.items() if name.split(":")[0] in names}


class Batches:
    """Runs by name, launched together per world size when the first of them is asked for."""

    def __init__(self, runs: dict[str, Run], root: Path):
        self.runs = runs
        self.root = root
        self.outcomes: dict[str, Outcome] = {}
        self.launches = 0

    def run_dir(self, name: str) -> Path:
        return self.root / re.sub(r"[^\w.-]+", "_", name) / "run"

    def result(self, name: str) -> Outcome:
        if name not in self.runs:
            raise KeyError(f"no batched run named {name!r}")
        if name not in self.outcomes:
            nproc = self.runs[name].nproc
            names = [n for n, r in self.runs.items() if r.nproc == nproc]
            for n in names:
                source = self.runs[n].starts_from
                if source is not None:
                    if self.runs[source[0]].nproc == nproc:
                        raise ValueError(f"{n} starts from {source[0]}, of the same world size")
                    self.result(source[0])
            self._launch_all(names)
        return self.outcomes[name]

    def trained(self, name: str) -> Path:
        """The run dir of run `name`, asserting that it trained without error."""
        outcome = self.result(name)
        assert outcome.error is None, outcome.error
        return outcome.run_dir

    def _argv(self, name: str) -> list[str]:
        run = self.runs[name]
        fields = dict(run.fields)
        if run.starts_from is not None:
            source, step = run.starts_from
            checkpoint = self.run_dir(source) / "checkpoints" / f"step-{step:08d}"
            fields["checkpoint__resume_from"] = str(checkpoint)
        argv = []
        for key, value in overrides(self.run_dir(name), **fields):
            argv += [f"--{key}", value]
        return argv

    def _launch_all(self, names: list[str]) -> None:
        pending = []
        for name in names:
            # What `distrain train` checks before it starts any worker.
            try:
                _, cfg = parse_train_args(self._argv(name), worker=False)
                validate(cfg, self.runs[name].nproc)
                preflight(cfg)
            except DistrainError as e:
                self.outcomes[name] = Outcome(self.run_dir(name), f"launcher refused: {e}")
                continue
            pending.append(name)
        while pending:
            pending = self._launch(pending)

    def _launch(self, names: list[str]) -> list[str]:
        """Launch `names` in one torchrun job; the names still to run afterwards."""
        self.launches += 1
        nproc = self.runs[names[0]].nproc
        work = self.root / f"launch{self.launches}"
        status_dir = work / "status"
        status_dir.mkdir(parents=True)
        spec = {
            "status_dir": str(status_dir),
            "runs": [{"name": n, "argv": self._argv(n)} for n in names],
        }
        (work / "spec.json").write_text(json.dumps(spec))
        threads, _ = worker_threads(nproc)
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(threads))
        log = work / "launch.log"
        with log.open("w") as out:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "torch.distributed.run",
                    "--standalone",
                    f"--nproc-per-node={nproc}",
                    str(WORKER),
                    str(work / "spec.json"),
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
            try:
                proc.wait(timeout=TIMEOUT_PER_RUN_S * len(names))
                ending = f"exit code {proc.returncode}"
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                ending = f"timed out after {TIMEOUT_PER_RUN_S * len(names)} s"
        finished: dict[str, int] = {}
        errors: dict[str, list[str]] = {}
        for path in status_dir.glob("rank*.jsonl"):
            for line in path.read_text().splitlines():
                row = json.loads(line)
                if row["ok"]:
                    finished[row["name"]] = finished.get(row["name"], 0) + 1
                else:
                    errors.setdefault(row["name"], []).append(f"{path.stem}: {row['error']}")
        for i, name in enumerate(names):
            if finished.get(name) == nproc:
                self.outcomes[name] = Outcome(self.run_dir(name), None, log)
                continue
            # The first run not finished on every rank ended this launch.
            why = "\n".join(errors.get(name, [])) + "\nlaunch log tail:\n" + log.read_text()[-4000:]
            self.outcomes[name] = Outcome(
                self.run_dir(name), f"batched launch ({ending}; log {log}) failed:\n{why}", log
            )
            return names[i + 1 :]
        return []


# What a test module defines to put runs in the session's pool: `batched_runs(names)` gets the
# names of the module's test cases that this session selected and returns the runs they need.
POOL_HOOK = "batched_runs"


def pool_name(module: str, name: str) -> str:
    """The pool's name of run `name` of test module `module` (its `__name__`)."""
    return f"{module}::{name}"


def pool(items: list, root: Path) -> Batches:
    """Every selected module's `batched_runs` in one `Batches` (`items`: the session's selected
    test cases), runs that fail on purpose last."""
    names: dict[ModuleType, set[str]] = {}
    for item in items:
        module = getattr(item, "module", None)
        if module is not None:
            names.setdefault(module, set()).add(item.name)
    runs: dict[str, Run] = {}
    for module, selected_names in names.items():
        declare = getattr(module, POOL_HOOK, None)
        if declare is not None:
            for name, run in declare(selected_names).items():
                if run.starts_from is not None:
                    source, step = run.starts_from
                    run = replace(run, starts_from=(pool_name(module.__name__, source), step))
                runs[pool_name(module.__name__, name)] = run
    return Batches(dict(sorted(runs.items(), key=lambda named: named[1].fails)), root)
