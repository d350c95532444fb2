"""Tensor + sequence parallel parity: a GPT split over 2 ranks against the plain GPT, same seed.

Each worker builds the reference model and the TP model side by side and compares loss,
every parameter's gradient, the gradient norm distrain clips with and the loss after 3 AdamW
steps. Workers
write what they measured to a JSON file; the parent asserts, so a failure shows the numbers. All
variants share one process group: spawning 2 ranks costs ~3 s.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from helpers import process_group
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from distrain.errors import ConfigError
from distrain.models.decoder.model import Decoder, ModelArgs, init_weights
from distrain.models.gpt.spec import GPT_SPEC
from distrain.parallel.grad_norm import clip_grad_norm
from distrain.parallel.tensor import (
    apply_tensor_parallel,
    check_sequence_length,
    tp_loss_context,
)

WORLD_SIZE = 2
SEED = 7
STEPS = 3
BATCH, SEQ = 2, 8
SMALL = dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, ffn_dim=64, max_seq_len=16)

# name -> (ModelArgs overrides, sequence_parallel, build on meta)
VARIANTS: dict[str, tuple[dict, bool, bool]] = {
    "rope-rmsnorm": ({"pos_emb": "rope", "norm": "rmsnorm"}, False, True),
    "rope-rmsnorm-sp": ({"pos_emb": "rope", "norm": "rmsnorm"}, True, True),
    "learned-layernorm": ({"pos_emb": "learned", "norm": "layernorm"}, False, True),
    "learned-layernorm-sp": ({"pos_emb": "learned", "norm": "layernorm"}, True, True),
    "tied-sp": ({"tie_embeddings": True}, True, True),
    "tied": ({"tie_embeddings": True, "pos_emb": "learned"}, False, True),
    "materialized-sp": ({"pos_emb": "learned"}, True, False),
    # Llama: SwiGLU's gate splits like w_up; 2 kv heads split over 2 ranks, one group each.
    "llama-gqa-sp": (
        {
            "mlp": "swiglu",
            "n_kv_heads": 2,
            "rope_scaling_factor": 4.0,
            "rope_original_max_seq_len": 8,
        },
        True,
        True,
    ),
    # GPT-2: biases in every linear (column-parallel ones split, row-parallel ones replicated)
    # and in the LayerNorms.
    "gpt2-bias": (
        {"bias": True, "norm": "layernorm", "pos_emb": "learned", "tie_embeddings": True},
        False,
        True,
    ),
}

# fp32 throughout. The TP model sums the same products in a different order (row-parallel
# all-reduces, the vocab-parallel logsumexp), so values differ by rounding only: measured loss
# differences are <= 1 ulp of a loss near 4.2 (4.8e-7) and gradient differences <= 1e-7.
LOSS_TOL = 2e-6
GRAD_TOL = 1e-6
# The clipped norm combines per-shard norms across ranks (a different grouping of the squares);
# measured relative differences <= 1.4e-6.
GRAD_NORM_RTOL = 1e-5
# AdamW divides each update by sqrt(v), so for near-zero gradients rounding noise can change an
# update by up to lr; measured loss differences after 3 steps are still <= 4.8e-7, 5e-6 leaves
# room for that amplification.
STEP_LOSS_TOL = 5e-6


def _batches(vocab_size: int, seq: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(SEED)
    tokens = torch.randint(0, vocab_size, (STEPS + 1, BATCH, seq + 1), generator=gen)
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _loss(model: Decoder, inputs: torch.Tensor, targets: torch.Tensor, *, tp: bool) -> torch.Tensor:
    """Mean cross entropy over the batch, accumulating gradients over micro-batches of one
    sequence; each loss and its backward inside the TP loss context, the one the trainer uses
    (ParallelModel.loss_context)."""
    total = torch.zeros(())
    for micro_inputs, micro_targets in zip(inputs.split(1), targets.split(1), strict=True):
        with tp_loss_context(tp):
            loss = F.cross_entropy(model(micro_inputs).flatten(0, 1), micro_targets.flatten())
            (loss / len(inputs)).backward()
        total += _full(loss.detach()) / len(inputs)
    return total


def _build_tp(args: ModelArgs, mesh: DeviceMesh, *, sequence_parallel: bool, meta: bool) -> Decoder:
    if not meta:
        model = Decoder(args)
        init_weights(model, args, SEED)
        apply_tensor_parallel(model, mesh, sequence_parallel=sequence_parallel, spec=GPT_SPEC)
        return model
    with torch.device("meta"):
        model = Decoder(args)
    apply_tensor_parallel(model, mesh, sequence_parallel=sequence_parallel, spec=GPT_SPEC)
    model.to_empty(device="cpu")
    init_weights(model, args, SEED)
    return model


def _compare(mesh: DeviceMesh, overrides: dict, sequence_parallel: bool, meta: bool) -> dict:
    """Train the reference and the TP model side by side; the largest differences seen."""
    args = ModelArgs(**SMALL, **overrides)
    reference = Decoder(args)
    init_weights(reference, args, SEED)
    model = _build_tp(args, mesh, sequence_parallel=sequence_parallel, meta=meta)

    names = [name for name, _ in reference.named_parameters()]
    if [name for name, _ in model.named_parameters()] != names:
        raise AssertionError("TP changed parameter names (checkpoint keys)")
    plain = [name for name, p in model.named_parameters() if not isinstance(p, DTensor)]
    if plain:
        raise AssertionError(f"parameters left plain under TP: {plain}")

    optimizers = [
        torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1, foreach=True)
        for m in (reference, model)
    ]
    result = {"loss": 0.0, "grad": 0.0, "grad_norm": 0.0, "step_loss": 0.0}
    for step, (inputs, targets) in enumerate(_batches(args.vocab_size, SEQ)):
        ref_loss = _loss(reference, inputs, targets, tp=False)
        tp_loss = _loss(model, inputs, targets, tp=True)
        key = "loss" if step == 0 else "step_loss"
        result[key] = max(result[key], (tp_loss - ref_loss).abs().item())
        if step == 0:
            ref_grads = {name: p.grad for name, p in reference.named_parameters()}
            result["grad"] = max(
                (_full(p.grad) - ref_grads[name]).abs().max().item()
                for name, p in model.named_parameters()
            )
        # The trainer's clipping (distrain.parallel.grad_norm): the TP model's Shard and
        # Replicate gradients must give the reference's norm. Every rank holds every parameter
        # (no pp), so holders = WORLD_SIZE; the reference's plain gradients are the same on both
        # ranks and count once.
        norms = [
            clip_grad_norm(list(m.parameters()), 1.0, holders=WORLD_SIZE)
            for m in (reference, model)
        ]
        relative = ((_full(norms[1]) - norms[0]).abs() / norms[0]).item()
        result["grad_norm"] = max(result["grad_norm"], relative)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return result


def _worker(rank: int, tmp_path: Path) -> None:
    torch.set_num_threads(1)  # 2 ranks on 2 cores
    with process_group(rank, WORLD_SIZE, store_file=tmp_path / "store", timeout_s=60):
        mesh = init_device_mesh("cpu", (WORLD_SIZE,), mesh_dim_names=("tp",))
        results = {name: _compare(mesh, *variant) for name, variant in VARIANTS.items()}

        # An odd length under SP must be refused before any collective (gloo would abort).
        args = ModelArgs(**SMALL)
        model = _build_tp(args, mesh, sequence_parallel=True, meta=True)
        try:
            model(torch.zeros(1, SEQ - 1, dtype=torch.long))
        except ConfigError as err:
            results["odd_length_error"] = str(err)
        (tmp_path / f"rank{rank}.json").write_text(json.dumps(results))


@pytest.mark.slow
def test_tensor_parallel_matches_plain_model(tmp_path):
    mp.spawn(_worker, args=(tmp_path,), nprocs=WORLD_SIZE)
    for rank in range(WORLD_SIZE):
        results = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert "training.seq_len" in results.pop("odd_length_error", "")
        assert results.keys() == VARIANTS.keys()
        for name, got in results.items():
            assert got["loss"] <= LOSS_TOL, (name, got)
            assert got["grad"] <= GRAD_TOL, (name, got)
            assert got["grad_norm"] <= GRAD_NORM_RTOL, (name, got)
            assert got["step_loss"] <= STEP_LOSS_TOL, (name, got)


def test_check_sequence_length():
    with pytest.raises(ConfigError, match="training.seq_len"):
        check_sequence_length(127, 2)
    check_sequence_length(128, 4)
