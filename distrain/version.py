"""distrain's version, for whatever records or prints it (a checkpoint's manifest, `distrain
--version`, the package's `__version__`): a leaf that imports nothing of distrain, so that none
of them imports the package root."""

from __future__ import annotations


def version() -> str:
    """The installed distribution's version or, run from a source tree never installed (a
    checkout on PYTHONPATH), the version its pyproject.toml declares."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("distrain")
    except PackageNotFoundError:
        import tomllib
        from pathlib import Path

        pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
        return str(tomllib.loads(pyproject.read_text())["project"]["version"])


# The torch releases distrain supports, the same specifier as pyproject.toml's torch requirement
# (tests/test_torch_range.py holds them equal). Both ends are tested: CI runs the whole suite on
# 2.13 and the compatibility suite (`pytest -m compat`) on 2.11 and 2.14; what differs between
# them is in distrain/torch_compat.py.
TORCH_RANGE = ">=2.11,<2.15"
_LOWEST, _BELOW = (2, 11), (2, 15)


def check_torch(found: str | None = None) -> None:
    """Refuse, in one line, a torch outside TORCH_RANGE. `found`: a torch version string
    (`2.14.1+cu128`); by default the imported torch's `__version__` or, before torch is
    imported (`import distrain` imports no torch), the installed distribution's version, read
    without importing it. No torch installed: nothing to check (its import fails by itself)."""
    import sys

    if found is None:
        torch = sys.modules.get("torch")
        if torch is not None:
            found = torch.__version__
        else:
            from importlib.metadata import PackageNotFoundError
            from importlib.metadata import version as installed

            try:
                found = installed("torch")
            except PackageNotFoundError:
                return
    release = torch_release(found)
    if release == (0, 0) or not _LOWEST <= release < _BELOW:
        raise ImportError(f"distrain needs torch{TORCH_RANGE}; this environment has torch {found}")


def torch_release(found: str | None = None) -> tuple[int, int]:
    """A torch version's (major, minor): what decides, 2.15.0a0+git (a nightly) being 2.15;
    (0, 0) for a string that is no version. `found`: by default the imported torch's."""
    import re

    if found is None:
        import torch

        found = torch.__version__
    parsed = re.match(r"(\d+)\.(\d+)", str(found))
    return (int(parsed.group(1)), int(parsed.group(2))) if parsed else (0, 0)
