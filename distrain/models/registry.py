"""The model families distrain can build, by name: each a `ModelSpec` (parallel/spec.py) that the
trainer and planner hand to the parallel mechanisms. The GPT (models/gpt/) is registered here; a
family defined elsewhere registers itself with `register_family`."""

from __future__ import annotations

from typing import Any

from distrain.errors import ConfigError
from distrain.models.gpt.spec import GPT_SPEC
from distrain.parallel.spec import ModelSpec

FAMILIES: dict[str, ModelSpec] = {}


def register_family(spec: ModelSpec) -> None:
    """Make `spec` known under `spec.name` (again for the same spec is a no-op)."""
    known = FAMILIES.get(spec.name)
    if known is not None and known is not spec:
        raise ValueError(f"a model family named {spec.name!r} is already registered")
    FAMILIES[spec.name] = spec


def model_family(name: str) -> ModelSpec:
    if name not in FAMILIES:
        raise ConfigError(f"unknown model family {name!r}; choose one of {', '.join(FAMILIES)}")
    return FAMILIES[name]


def family_of(args: Any) -> ModelSpec:
    """The family whose models `args` describes (by the type of `args`)."""
    for spec in FAMILIES.values():
        if isinstance(args, spec.args_type):
            return spec
    raise ValueError(f"no registered model family takes {type(args).__name__}")


register_family(GPT_SPEC)
