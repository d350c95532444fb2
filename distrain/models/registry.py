"""The model families distrain can build, by name (`model.family`): each a `ModelSpec`
(family/spec.py) that every other component reads.

The families in this package are registered here. A family defined elsewhere registers itself
with `register_family`, or, to be found by `distrain train` and its workers with no code run
first, names its spec in its distribution's `distrain.model_families` entry point
(`name = "package.module:SPEC"`), loaded the first time a family is asked for that is not known.
"""

from __future__ import annotations

import dataclasses
import json
from importlib.metadata import entry_points
from typing import Any

import torch
from torch import nn

from distrain.config.schema import ModelConfig
from distrain.errors import ConfigError
from distrain.family.spec import ModelShape, ModelSpec
from distrain.models.gpt.spec import GPT_SPEC
from distrain.models.gpt2.spec import GPT2_SPEC
from distrain.models.llama.spec import LLAMA_SPEC
from distrain.models.mixtral.spec import MIXTRAL_SPEC
from distrain.models.qwen3.spec import QWEN3_SPEC

ENTRY_POINT_GROUP = "distrain.model_families"

FAMILIES: dict[str, ModelSpec] = {}


def register_family(spec: ModelSpec) -> None:
    """Make `spec` known under `spec.name` (again for the same spec is a no-op)."""
    known = FAMILIES.get(spec.name)
    if known is not None and known is not spec:
        raise ValueError(f"a model family named {spec.name!r} is already registered")
    FAMILIES[spec.name] = spec


def _load_entry_points() -> None:
    """Register every family an installed distribution declares; one that fails to load, or
    names something other than a `ModelSpec` of its own name, is a one-line error."""
    for point in entry_points(group=ENTRY_POINT_GROUP):
        if point.name in FAMILIES:
            continue
        try:
            spec = point.load()
        except Exception as e:
            raise ConfigError(
                f"model family {point.name!r} (entry point {point.value!r}) failed to load: "
                f"{type(e).__name__}: {e}"
            ) from e
        if not isinstance(spec, ModelSpec) or spec.name != point.name:
            raise ConfigError(
                f"entry point {point.name!r} = {point.value!r} must name a ModelSpec whose name "
                f"is {point.name!r}"
            )
        register_family(spec)


def families() -> dict[str, ModelSpec]:
    """Every family: this package's and those installed plugins declare."""
    _load_entry_points()
    return dict(FAMILIES)


def model_family(name: str) -> ModelSpec:
    if name not in FAMILIES:
        _load_entry_points()
    if name not in FAMILIES:
        raise ConfigError(
            f"model.family: unknown model family {name!r}; choose one of {', '.join(FAMILIES)}"
        )
    return FAMILIES[name]


def _fields_set(node: Any, prefix: str = "") -> list[str]:
    """The dotted names of `node`'s fields that are set (not None), nested sections too."""
    names = []
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        if dataclasses.is_dataclass(value):
            names += _fields_set(value, f"{prefix}{f.name}.")
        elif value is not None:
            names.append(f"{prefix}{f.name}")
    return names


ALWAYS_READ = ("family", "preset", "init_from")


DEFAULT_FAMILY = "gpt"
"""The family of an empty model.family whose model.preset no family holds (its error then
names the gpt presets)."""


def family_name(cfg: ModelConfig) -> str:
    """The model family `cfg` names: model.family, or where it is empty the family of
    model.preset (`family_of_preset`, as `distrain plan --preset` picks it)."""
    return cfg.family or family_of_preset(cfg.preset) or DEFAULT_FAMILY


def resolved(cfg: ModelConfig) -> ModelConfig:
    """`cfg` with model.family set (`family_name`)."""
    return cfg if cfg.family else dataclasses.replace(cfg, family=family_name(cfg))


def model_args(cfg: ModelConfig) -> Any:
    """The arguments of the model `cfg` ([model]) describes, from its family; a field set that
    the family does not read is refused in one line, and so is an explicit model.family that
    does not hold model.preset."""
    cfg = resolved(cfg)
    spec = model_family(cfg.family)
    ignored = [
        name
        for name in _fields_set(cfg)
        if name not in ALWAYS_READ and name not in spec.config_fields
    ]
    if ignored:
        reads = ", ".join(f"model.{n}" for n in sorted(spec.config_fields)) or "none of them"
        raise ConfigError(
            f"model.{ignored[0]} does not apply to model.family = {spec.name!r}; remove it "
            f"(that family reads {reads})"
        )
    owner = None if cfg.init_from or cfg.preset in spec.presets else family_of_preset(cfg.preset)
    if owner:  # only where model.family is set: empty, it is the preset's
        raise ConfigError(
            f"model.preset: {cfg.preset!r} is a preset of model.family {owner!r}, not of "
            f"model.family = {spec.name!r}; remove model.family (the preset names its family) "
            f"or set model.family = {owner!r}"
        )
    return spec.args_from_config(cfg)


def family_of_preset(preset: str) -> str | None:
    """The name of the first family (built-in ones first) with a preset named `preset`."""
    return next((f.name for f in families().values() if preset in f.presets), None)


def model_shape(cfg: ModelConfig) -> ModelShape:
    """The sizes of the model `cfg` describes (`model_args`' model)."""
    return model_family(family_name(cfg)).shape(model_args(cfg))


def model_record(cfg: ModelConfig) -> dict[str, Any]:
    """What a checkpoint's manifest records of the model it holds (its "model"): the family, the
    preset, the one-line summary (`ModelSpec.describe`), the resolved arguments, and every
    tensor's shape, which the launcher compares with the configured model before a resume
    (launch/preflight.py). Built on the meta device: nothing is allocated."""
    spec = model_family(family_name(cfg))
    args = model_args(cfg)
    with torch.device("meta"):
        model = spec.build(args)
    resolved = dataclasses.asdict(args) if dataclasses.is_dataclass(args) else repr(args)
    return {
        "family": spec.name,
        "preset": cfg.preset,
        "summary": spec.describe(args),
        "args": json.loads(json.dumps(resolved, default=str)),
        "tensors": {name: list(t.shape) for name, t in model.state_dict().items()},
    }


def build_model(cfg: ModelConfig) -> nn.Module:
    """The plain model `cfg` describes, on the meta device (the caller gives it storage)."""
    spec = model_family(family_name(cfg))
    args = model_args(cfg)
    with torch.device("meta"):
        return spec.build(args)


register_family(GPT_SPEC)
register_family(LLAMA_SPEC)
register_family(GPT2_SPEC)
register_family(QWEN3_SPEC)
register_family(MIXTRAL_SPEC)
