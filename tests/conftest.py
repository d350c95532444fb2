"""Shared fixtures."""

import subprocess

import pytest


@pytest.fixture
def check_ok():
    def check(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
        assert result.returncode == 0, f"exit {result.returncode}\n{result.stderr[-4000:]}"
        return result

    return check
