"""The planner's builds shared with its build workers (distrain/plan/build_sharing.py): a build
claimed by another process is waited for until it ends, never made twice, and not waited for
once its claimant is killed (a real SIGKILL from outside); builds sent ahead are made by a worker
while the planning process makes its own, and dropped when the plan is done; a plan with its own
workers answers as one without and leaves no claim or worker behind."""

from __future__ import annotations

import multiprocessing
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
from helpers import small_cluster

from distrain.config.schema import Config
from distrain.plan import build_sharing, built_rows
from distrain.plan.build_results import MemoryEstimate
from distrain.plan.build_sharing import SharedBuilds, make_claimed
from distrain.plan.build_store import BuildStore
from distrain.plan.build_workers import Pool
from distrain.plan.built_rows import memory_of
from distrain.plan.planned import planned_run
from distrain.plan.search import plan

LIMIT_S = 60


def small_config(n_layers: int = 2) -> Config:
    cfg = Config()
    cfg.run.device = "cpu"
    cfg.model.dim, cfg.model.n_layers, cfg.model.n_heads, cfg.model.ffn_dim = 32, n_layers, 2, 64
    cfg.training.seq_len, cfg.training.global_batch_size = 16, 2
    cfg.training.compile = False
    return cfg


def calls(*depths: int) -> list:
    """memory_of of small_config(n) on one rank (micro-batch 1) for each depth n."""
    found = []
    for n in depths:
        cfg = small_config(n)
        cfg.training.micro_batch_size = 1
        found.append((memory_of, planned_run(cfg, 1)))
    return found


def claimant(claims: Path, call) -> subprocess.Popen:
    """Another process that claims `call` (as a worker would) and then makes nothing: it ends
    its claim when told (a line on its stdin)."""
    name = build_sharing._name(*call)
    code = (
        "import os, sys; from pathlib import Path; from distrain.plan import build_sharing as b\n"
        f"folder = Path({str(claims)!r}); assert b._claim(folder, {name!r})\n"
        f"print('claimed', flush=True); sys.stdin.readline(); b._end(folder, {name!r})\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline() == "claimed\n"
    return proc


def in_thread(function) -> threading.Thread:
    thread = threading.Thread(target=function, daemon=True)
    thread.start()
    return thread


@pytest.fixture
def shared(tmp_path):
    """Builds shared with one worker, which imports the planner when sent a build."""
    with Pool(1) as pool, SharedBuilds(pool, BuildStore(tmp_path)) as builds:
        yield builds


def counted(monkeypatch) -> list:
    """The fake builds made in this process, by depth."""
    made, real = [], built_rows.estimate_memory

    def estimate(run, **kwargs):
        made.append(run.config.model.n_layers)
        return real(run, **kwargs)

    monkeypatch.setattr(built_rows, "estimate_memory", estimate)
    return made


def test_a_build_another_process_claimed_is_waited_for_and_not_made_here(shared, monkeypatch):
    made = counted(monkeypatch)
    (first, second) = calls(2, 3)
    other = claimant(shared.claims, second)
    cache: dict = {}
    waiting = in_thread(lambda: shared.now([first, second], cache))
    try:
        deadline = time.monotonic() + LIMIT_S
        while made != [2] and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)
        # Its own build made, the claimed one waited for while its claimant lives.
        assert made == [2] and waiting.is_alive()
    finally:
        other.communicate("end\n", timeout=LIMIT_S)
    waiting.join(LIMIT_S)
    assert not waiting.is_alive() and made == [2]


def test_a_build_whose_claimant_is_killed_is_not_waited_for(shared, monkeypatch):
    """SIGKILL of the claimant (from outside, as the OOM killer would a worker): the planning
    process stops waiting, and its own call makes the build."""
    made = counted(monkeypatch)
    (call,) = calls(2)
    other = claimant(shared.claims, call)
    cache: dict = {}
    waiting = in_thread(lambda: shared.now([call], cache))
    time.sleep(0.5)
    assert waiting.is_alive() and made == []
    other.send_signal(signal.SIGKILL)
    other.wait(LIMIT_S)
    waiting.join(LIMIT_S)
    assert not waiting.is_alive() and made == []
    memory_of(call[1], cache, store=shared.store)
    assert made == [2]


def test_builds_sent_ahead_are_made_by_a_worker_and_read_back_here(shared, monkeypatch):
    made = counted(monkeypatch)
    shared.pool.start()
    ahead = calls(3, 4)
    shared.ahead(ahead)
    deadline = time.monotonic() + LIMIT_S
    while not all(built_rows.kept(*c, shared.store) for c in ahead):
        assert time.monotonic() < deadline, "the worker made no build sent ahead"
        time.sleep(0.05)
    cache: dict = {}
    shared.now(ahead, cache)
    for call in ahead:
        assert isinstance(memory_of(call[1], cache, store=shared.store), MemoryEstimate)
    assert made == []  # every one read back from the worker's


def test_a_build_sent_after_the_plan_is_done_is_not_made(tmp_path, monkeypatch):
    made = counted(monkeypatch)
    store = BuildStore(tmp_path / "builds")
    with Pool(1) as pool:
        shared = SharedBuilds(pool, store)
        claims = str(shared.claims)
        (call,) = calls(2)
        shared.close()
        make_claimed("memory_of", call[1], store, claims)
    assert made == [] and not store.directory.exists()


def test_a_worker_that_claims_as_the_plan_ends_builds_nothing(tmp_path, monkeypatch):
    """The race CI met: a worker reads no stop file, the plan ends (`close` marks it and lists
    the claims), then the worker claims. It builds nothing, and `close` removes the folder with
    its late claim in it."""
    made = counted(monkeypatch)
    store = BuildStore(tmp_path / "builds")
    with Pool(1) as pool:
        shared = SharedBuilds(pool, store)
        claims = shared.claims
        (call,) = calls(2)
        (claims / build_sharing.STOP).touch()  # close's first step, after the worker's check
        checks = []  # the worker's first check saw no stop file

        def stopped(folder: Path) -> bool:
            checks.append(folder)
            return len(checks) > 1 and real(folder)

        real = build_sharing._stopped
        monkeypatch.setattr(build_sharing, "_stopped", stopped)
        make_claimed("memory_of", call[1], store, str(claims))
        shared.close()
    assert len(checks) == 2 and made == [] and not store.directory.exists()
    assert not claims.exists() and not claims.with_name(claims.name + ".closed").exists()


def test_a_plan_with_its_own_worker_answers_as_one_without_and_leaves_nothing(tmp_path):
    """Every row (memory, source, fit, reason, rank) equal to one process's; no claims folder
    nor worker process left afterwards."""
    cluster = small_cluster(4, 9e5)
    options = dict(stages=(0,), checkpointing=("none",), max_micro_batch=1, verify=2)
    cfg = small_config(8)
    cfg.training.global_batch_size = 8
    claims_before = set(Path(tempfile.gettempdir()).glob("distrain-plan-claims-*"))
    alone = [r.as_dict() for r in plan(cfg, cluster, workers=1, **options)]
    pooled = [
        r.as_dict() for r in plan(cfg, cluster, workers=2, store=BuildStore(tmp_path), **options)
    ]
    assert pooled == alone
    assert {r["memory_source"] for r in pooled} == {"fake build", "model"}
    assert True in {r["fits"] for r in pooled} and False in {r["fits"] for r in pooled}
    assert set(Path(tempfile.gettempdir()).glob("distrain-plan-claims-*")) == claims_before
    assert multiprocessing.active_children() == []
