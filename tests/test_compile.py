"""training.compile: "auto" decided per device (parallel/mesh.py) and the compile cache that
outlives a run (parallel/compile.py). That a compiled run trains like an eager one is a parity row
(tests/test_parity.py)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch
from helpers import one_rank_group

from distrain.models.decoder.model import Decoder, ModelArgs, init_weights, summed_next_token_loss
from distrain.parallel.compile import apply_compile, use_persistent_compile_cache
from distrain.parallel.device import resolve_compile


def test_explicit_compile_is_kept_and_auto_compiles_on_cuda_only():
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    for device in (cpu, cuda):
        assert resolve_compile(True, device) is True
        assert resolve_compile(False, device) is False
    assert resolve_compile("auto", cuda) is True
    assert resolve_compile("auto", cpu) is False


def test_compile_cache_lives_in_the_users_cache_dir_unless_they_chose_one(monkeypatch, tmp_path):
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    expected = tmp_path / "xdg" / "distrain" / "torch-compile"
    assert use_persistent_compile_cache() == expected
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(expected)

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert use_persistent_compile_cache() == tmp_path / "home" / ".cache/distrain/torch-compile"

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert use_persistent_compile_cache() == tmp_path / "mine"


def _compiled_forward(tokens: torch.Tensor) -> torch.Tensor:
    """A fresh tiny model compiled whole, as a new process would: nothing compiled in memory."""
    torch._dynamo.reset()
    args = ModelArgs(dim=32, n_layers=1, n_heads=2, ffn_dim=64, max_seq_len=32)
    model = Decoder(args)
    init_weights(model, args, seed=1)
    apply_compile(model, whole=True, blocks=model.blocks)
    with torch.no_grad():
        return model(tokens)


@pytest.mark.slow
def test_a_second_compile_is_served_from_the_cache_on_disk(monkeypatch, tmp_path):
    from torch._dynamo.utils import counters

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    counters.clear()
    first = _compiled_forward(tokens)
    assert counters["inductor"]["fxgraph_cache_miss"] >= 1
    assert counters["inductor"]["fxgraph_cache_hit"] == 0
    assert any(Path(tmp_path / "cache").rglob("*.py")), "nothing was written to the cache dir"
    counters.clear()
    second = _compiled_forward(tokens)
    assert counters["inductor"]["fxgraph_cache_hit"] >= 1
    assert counters["inductor"]["fxgraph_cache_miss"] == 0
    assert torch.equal(first, second)


def test_given_targets_the_model_returns_the_loss_it_would_be_scored_by():
    # What lets a model compiled whole hold the loss in its graph (ParallelModel.loss_in_model):
    # the same loss, bit for bit, and the same gradients as the loss taken outside the model.
    args = ModelArgs(dim=32, n_layers=1, n_heads=2, ffn_dim=64, max_seq_len=32)
    model = Decoder(args)
    init_weights(model, args, seed=1)
    tokens = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(0))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    inside = model(inputs, targets=targets)
    inside.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    outside = summed_next_token_loss(model(inputs), targets)
    outside.backward()
    assert inside.shape == () and torch.equal(inside, outside)
    for got, p in zip(grads, model.parameters(), strict=True):
        assert torch.equal(got, p.grad)


@pytest.mark.slow
def test_compiled_whole_model_holds_the_loss_in_its_one_graph_and_evaluates_eagerly():
    from torch._dynamo.utils import counters

    from distrain.config.schema import Config
    from distrain.parallel.compress import CommStats
    from distrain.parallel.parallelize import parallelize

    torch._dynamo.reset()
    cfg = Config()
    cfg.model.dim, cfg.model.n_layers, cfg.model.n_heads, cfg.model.ffn_dim = 32, 1, 2, 64
    cfg.training.seq_len, cfg.training.micro_batch_size = 32, 2
    with one_rank_group(cfg) as (plan, ctx, mesh, dp_mesh):
        models = {}
        for compiled in (False, True):
            training = dataclasses.replace(plan.config.training, compile=compiled)
            planned = dataclasses.replace(
                plan, config=dataclasses.replace(plan.config, training=training)
            )
            models[compiled] = parallelize(planned, mesh, dp_mesh, ctx, CommStats())
        tokens = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(0))
        batch = [(tokens[:, :-1], tokens[:, 1:])]
        assert models[True].loss_in_model and not models[False].loss_in_model
        counters.clear()
        got, want = (models[c].forward_backward(batch, lambda x: x) for c in (True, False))
        # One graph, ending in the loss: no second graph for a loss taken outside the model.
        assert counters["stats"]["unique_graphs"] == 1
        # Inductor fuses and reassociates fp32 sums: rounding only (~1e-7 measured).
        assert abs(got.item() - want.item()) <= 1e-6 * want.item()
        evaluated = [models[c].eval_loss(batch)[0] for c in (True, False)]
        # Evaluation (no_grad) ran the compiled model eagerly rather than compile again.
        assert counters["stats"]["unique_graphs"] == 1
        assert abs(evaluated[0].item() - evaluated[1].item()) <= 1e-6 * evaluated[1].item()
