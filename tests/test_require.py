"""tests/conftest.py's DISTRAIN_REQUIRE: a skip of a test marked `requires(name)` fails the run
where the variable names that capability, and stays a skip elsewhere."""

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
"""


@pytest.fixture
def suite(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makeconftest(Path(__file__).with_name("conftest.py").read_text())
    pytester.makepyfile(SKIPPING)
    return pytester


def test_skips_stay_skips_without_requirement(suite, monkeypatch):
    monkeypatch.delenv("DISTRAIN_REQUIRE", raising=False)
    suite.runpytest("-p", "no:cacheprovider").assert_outcomes(skipped=3)


def test_required_capability_turns_its_skip_into_a_failure(suite, monkeypatch):
    monkeypatch.setenv("DISTRAIN_REQUIRE", "netlab")
    result = suite.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(failed=1, skipped=2)
    result.stdout.fnmatch_lines(
        ["*skipped, but DISTRAIN_REQUIRE says this machine has netlab: *needs root*"]
    )


def test_unknown_capability_is_a_usage_error(suite, monkeypatch):
    monkeypatch.setenv("DISTRAIN_REQUIRE", "netlab,slrum")
    result = suite.runpytest("-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*unknown capabilities*slrum*choose from netlab*"])
