"""distrain: train transformer models across many processes and machines on torch.distributed.

The Python API, for using distrain as a library rather than through the `distrain` command:

    import distrain

    cfg = distrain.load_config("configs/tiny.toml", overrides={"training.steps": 100})
    distrain.run_training(cfg)  # this process: alone, or one rank of a torchrun group

- `load_config(path=None, *, overrides=None) -> Config`: the defaults, then the TOML file at
  `path`, then `overrides` (dotted field names to values, `{"training.steps": 100}`; a string
  is parsed as on the command line), checked field by field: a `ConfigError` names the field.
- `run_training(config) -> None`: train per `config` in this process, as one rank of the
  torchrun group its environment describes (start the script with `torchrun --nproc-per-node
  N`) or alone in a 1-process group. Everything lands in `config.run.dir`: config.toml,
  metrics.jsonl, logs/ and the checkpoints. (`distrain.train` is the package that trains.)
- `presets(family="gpt") -> dict[str, Any]`: the named model shapes (`model.preset`) of a
  model family (`model.family`), each the family's arguments.
- `Config`: the run configuration, one dataclass per section (run, model, data, training, ...);
  `distrain train --help` lists every field.
- `DistrainError`, and `ConfigError` among its kinds: the errors a user can fix, in one line.

Nothing heavy loads at `import distrain`: each name imports its module (and torch) on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from distrain.version import check_torch

# A torch outside the supported range is refused here, before any of it is used (one line).
check_torch()

if TYPE_CHECKING:
    from collections.abc import Mapping
    from pathlib import Path
    from typing import Any

    from distrain.config.schema import Config


__all__ = [
    "Config",
    "ConfigError",
    "DistrainError",
    "__version__",
    "load_config",
    "presets",
    "run_training",
]

# The classes and functions of the API, by the module that defines them: imported when first
# asked for.
_LAZY = {
    "Config": "distrain.config.schema",
    "ConfigError": "distrain.errors",
    "DistrainError": "distrain.errors",
    "run_training": "distrain.train.worker",
}


def load_config(
    path: str | Path | None = None, *, overrides: Mapping[str, Any] | None = None
) -> Config:
    """The run configuration: defaults < the TOML file at `path` < `overrides`, validated."""
    from distrain.config.io import load_config as load

    return load(path, list((overrides or {}).items()))


def presets(family: str = "gpt") -> dict[str, Any]:
    """The named model shapes of `family` (a copy: changing it changes no preset)."""
    from distrain.models.registry import model_family

    return dict(model_family(family).presets)


def __getattr__(name: str) -> Any:
    if name == "__version__":
        from distrain.version import version

        globals()[name] = version()
        return globals()[name]
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'distrain' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
