"""A decoder family's arguments from the `[model]` section: its flavor named by `model.preset`
(or the config.json of the Hugging Face folder named by `model.init_from`) with the `model.*`
fields set over it."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

from distrain.config.schema import ConfigError, ModelConfig
from distrain.models.decoder.model import ModelArgs

# model.<field> -> the ModelArgs field it sets, where the names differ.
ARGUMENT_OF = {"head_dim": "attention_head_dim"}


def decoder_args(
    cfg: ModelConfig,
    presets: Mapping[str, ModelArgs],
    from_hf: Callable[[str], ModelArgs] | None,
) -> ModelArgs:
    """The preset of `presets` named by cfg.preset (or the Hugging Face folder of
    cfg.init_from, read by `from_hf`; None: the family reads none) with cfg's non-None fields
    applied over it (a sequence longer than its max_seq_len is refused by layout/rules.py,
    never silently allowed for). The family's `config_fields` decide which fields may be set
    (models/registry.py)."""
    if cfg.init_from:
        if from_hf is None:
            raise ConfigError(
                f"model.init_from: model.family {cfg.family!r} reads no Hugging Face folder; "
                "set model.family to the folder's family (`distrain presets` lists them)"
            )
        base = from_hf(cfg.init_from)
    elif cfg.preset not in presets:
        raise ConfigError(
            f"model.preset: unknown preset {cfg.preset!r} of model.family {cfg.family!r}; "
            f"choose one of {', '.join(presets)}"
        )
    else:
        base = presets[cfg.preset]
    overrides = {
        ARGUMENT_OF.get(f.name, f.name): getattr(cfg, f.name)
        for f in dataclasses.fields(cfg)
        if f.name not in ("family", "preset", "init_from", "moe")
        and getattr(cfg, f.name) is not None
    }
    moe = {
        f.name: getattr(cfg.moe, f.name)
        for f in dataclasses.fields(cfg.moe)
        if getattr(cfg.moe, f.name) is not None
    }
    overrides["moe"] = dataclasses.replace(base.moe, **moe)
    args = dataclasses.replace(base, **overrides)
    try:
        args.check()
    except ValueError as e:
        raise ConfigError(f"model: {e}") from e
    return args
