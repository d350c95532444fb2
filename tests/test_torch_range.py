"""The supported torch range: declared once for pip (pyproject.toml) and once for the import-time
check (distrain/version.py), the two equal; a torch outside it refused at `import distrain` in
one line naming the range; pip keeps an in-range torch it finds installed."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from distrain.version import TORCH_RANGE, check_torch

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.compat


def test_pyproject_declares_the_range_the_import_checks():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    (torch,) = [
        Requirement(d) for d in pyproject["project"]["dependencies"] if d.startswith("torch")
    ]
    assert str(torch.specifier) == str(Requirement(f"torch{TORCH_RANGE}").specifier)


@pytest.mark.parametrize(
    "found", ["2.11.0", "2.11.0+cu126", "2.13.0+cpu", "2.14.1", "2.14.1+cu130", "2.14.0a0+git1"]
)
def test_a_torch_in_the_range_passes(found):
    check_torch(found)


@pytest.mark.parametrize("found", ["2.10.1+cu128", "2.15.0", "2.15.0a0+gitabc", "3.0.0", "1.13.1"])
def test_a_torch_outside_the_range_is_refused_naming_it(found):
    with pytest.raises(ImportError) as refused:
        check_torch(found)
    message = str(refused.value)
    assert "\n" not in message and TORCH_RANGE in message and found in message


def test_this_torch_is_in_the_range():
    import torch

    check_torch(torch.__version__)
    check_torch()  # the imported torch's own version


def test_import_distrain_refuses_a_torch_outside_the_range():
    """The package root checks the torch it would use (here a stand-in module already imported,
    as a user's script may have) before anything else of distrain runs."""
    code = (
        "import sys, types\n"
        "sys.modules['torch'] = types.SimpleNamespace(__version__='2.10.0+cu126')\n"
        "import distrain\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env
    )
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert last == (
        f"ImportError: distrain needs torch{TORCH_RANGE}; this environment has torch 2.10.0+cu126"
    )
