"""tests/conftest.py's DISTRAIN_REQUIRE: where it is set, every skip fails the run (a whole
module's too) except a test's marked `requires(name)` for a capability the variable does not
name; where it is unset, skips stay skips."""

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

SKIPPING = """
import pytest

@pytest.mark.requires("netlab")
def test_lab():
    pytest.skip("the network lab needs root")

@pytest.mark.requires("s3")
def test_other_capability():
    pytest.skip("no s3fs")

def test_unmarked():
    pytest.skip("not a capability")

def test_runs():
    pass
"""

MODULE_SKIP = """
import pytest

pytest.importorskip("a_package_that_is_not_installed")

def test_never_collected():
    pass
"""


@pytest.fixture
def suite(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makeconftest(Path(__file__).with_name("conftest.py").read_text())
    pytester.makepyfile(SKIPPING)
    return pytester


def test_skips_stay_skips_without_requirement(suite, monkeypatch):
    monkeypatch.delenv("DISTRAIN_REQUIRE", raising=False)
    suite.runpytest("-p", "no:cacheprovider").assert_outcomes(skipped=3, passed=1)


def test_a_strict_run_fails_every_skip_but_an_undeclared_capability(suite, monkeypatch):
    monkeypatch.setenv("DISTRAIN_REQUIRE", "netlab")
    result = suite.runpytest("-p", "no:cacheprovider", "-rA")
    # test_other_capability (s3, not declared) is the one skip left.
    result.assert_outcomes(failed=2, skipped=1, passed=1)
    result.stdout.fnmatch_lines(
        [
            "*skipped, but DISTRAIN_REQUIRE says this machine has netlab: *needs root*",
            "*skipped, but DISTRAIN_REQUIRE is set (a strict run) and the test is not marked*",
        ]
    )


def test_a_strict_run_fails_a_module_skipped_as_a_whole(pytester, monkeypatch):
    pytester.makeconftest(Path(__file__).with_name("conftest.py").read_text())
    pytester.makepyfile(test_module_skip=MODULE_SKIP)
    monkeypatch.delenv("DISTRAIN_REQUIRE", raising=False)
    pytester.runpytest("-p", "no:cacheprovider").assert_outcomes(skipped=1)
    monkeypatch.setenv("DISTRAIN_REQUIRE", "s3")
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(
        ["*skipped as a whole, but DISTRAIN_REQUIRE is set*a_package_that_is_not_installed*"]
    )


def test_unknown_capability_is_a_usage_error(suite, monkeypatch):
    monkeypatch.setenv("DISTRAIN_REQUIRE", "netlab,slrum")
    result = suite.runpytest("-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*unknown capabilities*slrum*choose from netlab*"])
