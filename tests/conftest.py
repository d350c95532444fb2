"""Shared fixtures, and skips that must not hide: `@pytest.mark.requires("netlab")` marks a test
that skips where a capability is missing; where `DISTRAIN_REQUIRE` (comma-separated, set by
.ci/run) names that capability, this machine is declared to have it, so such a skip is reported
as a failure with its reason."""

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


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "requires(name): skips where capability `name` is missing; a failure instead where "
        f"{REQUIRE_ENV} names it ({', '.join(CAPABILITIES)})",
    )
    required()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    if not report.skipped or hasattr(report, "wasxfail"):
        return
    needed = {mark.args[0] for mark in item.iter_markers("requires")} & required()
    if not needed:
        return
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    report.outcome = "failed"
    report.longrepr = (
        f"skipped, but {REQUIRE_ENV} says this machine has {', '.join(sorted(needed))}: {reason}"
    )


@pytest.fixture
def check_ok():
    def check(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
        assert result.returncode == 0, f"exit {result.returncode}\n{result.stderr[-4000:]}"
        return result

    return check
