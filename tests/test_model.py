"""The decoder the built-in families share: exact parameter counts, causality, seeded
layout-independent init; a family's fields and presets."""

import dataclasses

import pytest
import torch

from distrain.config.schema import ConfigError, ModelConfig
from distrain.models.decoder.counts import num_params
from distrain.models.decoder.model import Decoder, ModelArgs, full_init_value, init_weights
from distrain.models.registry import FAMILIES, model_args

SMALL = ModelArgs(vocab_size=64, dim=32, n_layers=2, n_heads=4, ffn_dim=64, max_seq_len=32)


# Every preset of the built-in families (all on the decoder), by (family, preset).
PRESETS = {
    (family.name, name): args
    for family in FAMILIES.values()
    if family.build is Decoder
    for name, args in family.presets.items()
}


@pytest.mark.parametrize("key", list(PRESETS), ids="/".join)
def test_param_count_is_exact(key):
    with torch.device("meta"):
        model = Decoder(PRESETS[key])
    assert num_params(PRESETS[key]) == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    "variant",
    [
        {},
        {"norm": "layernorm"},
        {"pos_emb": "learned"},
        {"tie_embeddings": True},
        {"mlp": "swiglu", "n_kv_heads": 2, "rope_scaling_factor": 8.0},
        {"bias": True, "norm": "layernorm", "n_kv_heads": 1},
    ],
)
def test_causal_and_counted(variant):
    args = dataclasses.replace(SMALL, **variant)
    model = Decoder(args)
    init_weights(model, args, seed=0)
    assert num_params(args) == sum(p.numel() for p in model.parameters())
    tokens = torch.randint(0, args.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    logits = model(tokens)
    assert logits.shape == (2, 16, args.vocab_size)
    changed = tokens.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % args.vocab_size
    # Positions before the change must not see it (exact: same ops on the same inputs).
    torch.testing.assert_close(model(changed)[:, :10], logits[:, :10], rtol=0, atol=0)
    assert not torch.allclose(model(changed)[:, 10:], logits[:, 10:])


def test_init_depends_on_seed_and_name_only():
    a, b = Decoder(SMALL), Decoder(SMALL)
    init_weights(a, SMALL, seed=3)
    init_weights(b, SMALL, seed=3)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb), name
    # Wrapper prefixes (DDP, activation checkpointing, compile) do not change a value.
    value = full_init_value("blocks.0.attn.wq.weight", torch.Size([32, 32]), SMALL, 3)
    wrapped = full_init_value(
        "module.blocks.0._checkpoint_wrapped_module.attn.wq.weight", torch.Size([32, 32]), SMALL, 3
    )
    assert torch.equal(value, wrapped)
    assert torch.equal(value, a.blocks["0"].attn.wq.weight)
    init_weights(b, SMALL, seed=4)
    assert not torch.equal(a.tok_emb.weight, b.tok_emb.weight)


def test_meta_build_then_materialize_matches_eager():
    with torch.device("meta"):
        meta = Decoder(SMALL)
    meta.to_empty(device="cpu")
    init_weights(meta, SMALL, seed=1)
    eager = Decoder(SMALL)
    init_weights(eager, SMALL, seed=1)
    tokens = torch.randint(0, 64, (1, 8))
    assert torch.equal(meta(tokens), eager(tokens))
    tied = dataclasses.replace(SMALL, tie_embeddings=True)
    with torch.device("meta"):
        meta = Decoder(tied)
    meta.to_empty(device="cpu")
    assert meta.output.weight is meta.tok_emb.weight


def test_model_overrides_and_errors():
    args = model_args(ModelConfig(preset="tiny", n_layers=2, max_seq_len=2048))
    assert args.n_layers == 2 and args.max_seq_len == 2048
    with pytest.raises(ConfigError, match="model.preset: unknown preset 'huge'"):
        model_args(ModelConfig(preset="huge"))
    # A preset names its family; an explicit family that does not hold it is refused.
    assert model_args(ModelConfig(preset="llama-tiny")).mlp == "swiglu"
    assert model_args(ModelConfig(family="llama", preset="llama-tiny")).mlp == "swiglu"
    with pytest.raises(ConfigError, match="'llama-tiny' is a preset of model.family 'llama', not"):
        model_args(ModelConfig(family="gpt", preset="llama-tiny"))
    # A family reads only its own fields: GPT-2's norm is its own.
    with pytest.raises(ConfigError, match="model.norm does not apply to model.family = 'gpt2'"):
        model_args(ModelConfig(family="gpt2", preset="gpt2-tiny", norm="rmsnorm"))
    with pytest.raises(ConfigError, match=r"model.dim \(100\) must be divisible by model.n_heads"):
        model_args(ModelConfig(dim=100, n_heads=3))


def test_a_preset_names_its_family():
    """model.preset alone picks its family (as `distrain plan --preset` does); an explicit
    model.family that does not hold the preset is one line naming both and the fix."""
    from distrain import load_config as api_load_config
    from distrain.models.registry import family_name, model_shape

    cfg = api_load_config(overrides={"model.preset": "llama-tiny"})
    assert family_name(cfg.model) == "llama"
    assert model_shape(cfg.model) == model_shape(ModelConfig(family="llama", preset="llama-tiny"))
    assert family_name(ModelConfig()) == "gpt"  # the default preset, tiny, is gpt's
    explicit = api_load_config(overrides={"model.preset": "llama-tiny", "model.family": "gpt"})
    with pytest.raises(ConfigError) as refused:
        model_args(explicit.model)
    assert str(refused.value) == (
        "model.preset: 'llama-tiny' is a preset of model.family 'llama', not of model.family = "
        "'gpt'; remove model.family (the preset names its family) or set model.family = 'llama'"
    )
