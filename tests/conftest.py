"""Shared fixtures, and skips that must not hide. `@pytest.mark.requires("netlab")` marks a test
that skips where a capability is missing. `DISTRAIN_REQUIRE` (comma-separated, set by .ci/run)
declares what this machine has; where it is set, the run is strict: every skip is reported as a
failure with its reason (a whole module's skip too, an `importorskip` of a missing package
among them), except a test's marked `requires(name)` for a capability the variable does not
name (the machine cannot run it: `cuda`, `netem` on CI)."""

import gc
import os
import subprocess

import pytest

REQUIRE_ENV = "DISTRAIN_REQUIRE"
# What each capability name stands for (a name outside this table in DISTRAIN_REQUIRE is a typo).
CAPABILITIES = {
    "netlab": "network namespaces with tc-shaped links (root, iproute2, util-linux)",
    "netem": "the netlab plus the kernel's netem qdisc (link delay)",
    "s3": "a loopback S3 server and s3fs (the dev extra)",
    "slurm": "Slurm's daemons and client (slurmctld, slurmd, munge), run as root",
    "cuda": "a CUDA device",
}


def required() -> set[str]:
    names = {n.strip() for n in os.environ.get(REQUIRE_ENV, "").split(",") if n.strip()}
    unknown = names - CAPABILITIES.keys()
    if unknown:
        raise pytest.UsageError(
            f"{REQUIRE_ENV} names unknown capabilities {sorted(unknown)}; "
            f"choose from {', '.join(CAPABILITIES)}"
        )
    return names


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--requires-only",
        metavar="NAME",
        help="run only the tests marked requires(NAME), e.g. cuda (benchmarks/gpu.sh)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    name = config.getoption("--requires-only")
    if name is None:
        return
    if name not in CAPABILITIES:
        raise pytest.UsageError(f"--requires-only {name}: choose from {', '.join(CAPABILITIES)}")
    keep = [i for i in items if name in {m.args[0] for m in i.iter_markers("requires")}]
    kept = set(keep)
    config.hook.pytest_deselected(items=[i for i in items if i not in kept])
    items[:] = keep


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "requires(name): skips where capability `name` is missing; a failure instead where "
        f"{REQUIRE_ENV} names it ({', '.join(CAPABILITIES)})",
    )
    required()


def pytest_collection_finish(session: pytest.Session) -> None:
    """Move what collection imported (torch, the test modules and what they import: ~400,000
    objects) out of the cyclic GC's sight: it lives for the whole session, and every full
    collection during the tests would scan it again (five in-process test files, loaded
    machine: the GC's CPU in this process 8.9 -> 3.5 s of 44 -> 38 s). Collected first, so
    that no garbage is frozen with it."""
    gc.collect()
    gc.freeze()
    # Runs in this process (train_in_process, ~75 of them) use one CPU thread, as each torchrun
    # worker of a multi-rank test does: for the tests' tiny models a second thread costs more
    # than it gains (an 8-step run: 1.1 s wall, 0.9 s CPU with one; 1.9 s, 1.6 s with two).
    import torch

    torch.set_num_threads(1)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    if not report.skipped or hasattr(report, "wasxfail"):
        return
    declared = required()
    if not declared:
        return
    marked = {mark.args[0] for mark in item.iter_markers("requires")}
    if marked and not marked & declared:
        return  # a capability this machine is not declared to have: the one allowed skip
    reason = _reason(report.longrepr)
    report.outcome = "failed"
    if marked & declared:
        why = f"{REQUIRE_ENV} says this machine has {', '.join(sorted(marked & declared))}"
    else:
        why = (
            f"{REQUIRE_ENV} is set (a strict run) and the test is not marked requires(name) "
            "for a capability it does not name"
        )
    report.longrepr = f"skipped, but {why}: {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector):
    """A whole module skipped (`pytest.skip(allow_module_level=True)`, a module-level
    `importorskip`) fails a strict run: its every test would otherwise pass unseen."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped and isinstance(collector, pytest.Module) and required():
        report.outcome = "failed"
        report.longrepr = (
            f"{collector.nodeid} skipped as a whole, but {REQUIRE_ENV} is set (a strict run): "
            f"{_reason(report.longrepr)}"
        )


def _reason(longrepr: object) -> str:
    return longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)


@pytest.fixture(scope="session")
def batch_pool(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """The multi-process runs that this session's test modules declare (`batched_runs`, see
    tests/batch.py): one torchrun launch per world size for the whole session, started by the
    first test that asks for a run of that size."""
    from batch import pool

    return pool(request.session.items, tmp_path_factory.mktemp("pool"))


@pytest.fixture
def check_ok():
    def check(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
        assert result.returncode == 0, f"exit {result.returncode}\n{result.stderr[-4000:]}"
        return result

    return check


# Where each test's time goes, for cutting CI time: with DISTRAIN_TEST_TIMES=path, one JSON line
# per test (setup, call and teardown together) with its wall seconds and the CPU seconds of this
# process and of the child processes it waited for (torchrun workers). Child CPU is far less
# sensitive to a loaded machine than wall time; wall minus CPU is time spent waiting (timeouts,
# sleeps, joins).
TIMES_ENV = "DISTRAIN_TEST_TIMES"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    path = os.environ.get(TIMES_ENV)
    if not path:
        yield
        return
    import json
    import resource
    import time

    def snapshot() -> tuple[float, float, float]:
        own = resource.getrusage(resource.RUSAGE_SELF)
        kids = resource.getrusage(resource.RUSAGE_CHILDREN)
        return time.monotonic(), own.ru_utime + own.ru_stime, kids.ru_utime + kids.ru_stime

    start = snapshot()
    yield
    end = snapshot()
    row = {
        "test": item.nodeid,
        "wall_s": round(end[0] - start[0], 2),
        "self_cpu_s": round(end[1] - start[1], 2),
        "child_cpu_s": round(end[2] - start[2], 2),
    }
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
