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
