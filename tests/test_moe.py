"""Mixture of experts on one process: the router against a hand-computed example, the grouped
experts against per-expert MLPs, exact parameter counts, and balancing that works."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from helpers import train_in_process

from distrain.models.decoder.counts import active_params, flops_per_token, num_params
from distrain.models.decoder.model import Decoder, init_weights
from distrain.models.decoder.moe import GroupedExperts, MoE, MoEArgs
from distrain.models.gpt.flavors import PRESETS

# Router columns are log-probabilities (+ a constant for the z-loss): a one-hot token e_j gets
# exactly the probabilities PROBS[j] and the router logsumexp LSE[j].
PROBS = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.6, 0.3]])
LSE = torch.tensor([1.0, 0.0])
TOKENS = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [1.0, 0.0]])  # e0, e1, e0, e0


def hand_moe(**fields) -> MoE:
    args = MoEArgs(num_experts=3, **fields)
    moe = MoE(2, args, 4)
    with torch.no_grad():
        moe.router.weight.copy_((PROBS.log() + LSE[:, None]).t())
        gen = torch.Generator().manual_seed(0)
        for p in moe.experts.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    return moe


def expert(moe: MoE, e: int, x: torch.Tensor) -> torch.Tensor:
    w = moe.experts
    return F.gelu(x @ w.w_up[e], approximate="tanh") @ w.w_down[e]


def test_router_matches_hand_computed_example():
    """Top-2 of 3 experts, capacity factor 0.75 over 4 tokens: capacity ceil(0.75 * 2 * 4 / 3) = 2.
    First choices (t0->0, t1->1, t2->0, t3->0) claim places before second choices (t0->1, t1->2,
    t2->1, t3->1): expert 0 keeps t0, t2 and drops t3; expert 1 keeps t1, t0 and drops t2, t3;
    expert 2 keeps t1. Gates are renormalised over the two choices before any drop."""
    moe = hand_moe(top_k=2, capacity_factor=0.75)
    out = moe(TOKENS[None])[0]
    e0, e1 = TOKENS[0], TOKENS[1]
    want = torch.stack(
        [
            0.5 / 0.8 * expert(moe, 0, e0) + 0.3 / 0.8 * expert(moe, 1, e0),
            0.6 / 0.9 * expert(moe, 1, e1) + 0.3 / 0.9 * expert(moe, 2, e1),
            0.5 / 0.8 * expert(moe, 0, e0),
            torch.zeros(2),
        ]
    )
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    assert moe.tokens_per_expert.tolist() == [3, 4, 1]
    assert int(moe.dropped) == 3
    # f = routed copies / 8 = (3, 4, 1) / 8; P = mean probabilities = (0.4, 0.375, 0.225).
    assert float(moe.aux_loss) == pytest.approx(3 * (3 / 8 * 0.4 + 4 / 8 * 0.375 + 1 / 8 * 0.225))
    assert float(moe.z_loss) == pytest.approx((3 * 1.0**2 + 0.0**2) / 4)
    assert float(moe.balancing_loss()) == pytest.approx(0.01 * float(moe.aux_loss))


def test_top1_gate_is_the_router_probability_and_bias_only_selects():
    switch = hand_moe(top_k=1)  # dropless: t0, t2, t3 all reach expert 0
    out = switch(TOKENS[None])[0]
    torch.testing.assert_close(out[1], 0.6 * expert(switch, 1, TOKENS[1]))
    torch.testing.assert_close(out[3], 0.5 * expert(switch, 0, TOKENS[0]))
    biased = hand_moe(top_k=2, balance="bias")
    biased.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.5]))
    out = biased(TOKENS[None])[0]
    # e0's scores become (0.5, 0.3, 0.7): experts 2 and 0, gated by probabilities 0.2 and 0.5.
    want = 0.2 / 0.7 * expert(biased, 2, TOKENS[0]) + 0.5 / 0.7 * expert(biased, 0, TOKENS[0])
    torch.testing.assert_close(out[0], want)
    assert float(biased.balancing_loss()) == 0.0  # no aux loss with bias balancing


def test_grouped_experts_match_one_mlp_per_expert():
    experts = GroupedExperts(3, 4, 6, gated=True)
    for p in experts.parameters():
        torch.nn.init.normal_(p)
    x = torch.randn(7, 4)
    counts = torch.tensor([2, 0, 5])
    rows = [x[:2], x[2:2], x[2:]]
    want = torch.cat(
        [
            (F.silu(r @ experts.w_gate[e]) * (r @ experts.w_up[e])) @ experts.w_down[e]
            for e, r in enumerate(rows)
        ]
    )
    torch.testing.assert_close(experts(x, counts), want)


@pytest.mark.parametrize("preset", ["moe-tiny", "switch-tiny"])
def test_param_counts_are_exact(preset):
    args = PRESETS[preset]
    model = Decoder(args)
    assert num_params(args) == sum(p.numel() for p in model.parameters())
    # One token uses the router and top_k experts of each MoE layer: tiny's parameters + router.
    tiny = PRESETS["tiny"]
    router = args.n_layers * args.dim * args.moe.num_experts
    assert active_params(args) == num_params(tiny) + router
    assert flops_per_token(args, 128) == flops_per_token(tiny, 128) + 6 * router


@pytest.mark.parametrize(("mlp", "bias"), [("swiglu", False), ("gelu", True)])
def test_param_counts_are_exact_for_gated_and_biased_experts(mlp, bias):
    # swiglu experts carry a third (gate) weight; a shared expert is a dense MLP with biases.
    args = dataclasses.replace(
        PRESETS["tiny"],
        mlp=mlp,
        bias=bias,
        norm="layernorm",
        moe=MoEArgs(num_experts=4, top_k=2, every=2, shared_experts=1, ffn_dim=64),
    )
    model = Decoder(args)
    assert num_params(args) == sum(p.numel() for p in model.parameters())
    gated = model.blocks["1"].moe.experts.w_gate is not None
    assert gated == (mlp == "swiglu")


def test_every_and_shared_experts_shape_the_model():
    args = dataclasses.replace(
        PRESETS["tiny"],
        n_layers=4,
        moe=MoEArgs(num_experts=4, top_k=2, every=2, shared_experts=1, ffn_dim=64),
    )
    model = Decoder(args)
    kinds = ["moe" if hasattr(b, "moe") else "mlp" for b in model.blocks.values()]
    assert kinds == ["mlp", "moe", "mlp", "moe"]
    assert model.blocks["1"].moe.shared.w_up.weight.shape == (64, args.dim)
    assert num_params(args) == sum(p.numel() for p in model.parameters())
    init_weights(model, args, seed=3)
    assert not model.blocks["3"].moe.expert_bias.any()
    out = model(torch.randint(0, args.vocab_size, (2, 8)))
    assert torch.isfinite(out).all()


# The balancing test's job: moe-tiny's routing on a 2-layer dim-64 model, 8 x 32 tokens per
# step, lr 1e-2 so the router drifts within few steps. cv = std / mean of tokens per expert.
BALANCE_STEPS = 24
BALANCE = {
    "model__preset": "moe-tiny",
    "model__n_layers": 2,
    "model__dim": 64,
    "training__steps": BALANCE_STEPS,
    "training__global_batch_size": 8,
    "training__micro_batch_size": 8,
    "training__seq_len": 32,
    "training__log_interval_steps": BALANCE_STEPS // 2,
    "training__eval_interval_steps": 0,
    "training__eval_batches": 1,
    "optim__lr": 1e-2,
    "optim__warmup_steps": 2,
    "checkpoint__interval_steps": 0,
    "metrics__tensorboard": False,
    "metrics__progress_bar": False,
}


def _last_cv(rows: list[dict]) -> float:
    return [r["moe_load_cv"] for r in rows if "moe_load_cv" in r][-1]


@pytest.fixture(scope="module")
def balance_runs(tmp_path_factory) -> dict[str, list[dict]]:
    """One 24-step run per balancing mode; the bias run keeps its final checkpoint."""
    root = tmp_path_factory.mktemp("balance")
    modes = {
        "none": {"checkpoint__at_end": False},
        "aux": {"model__moe__aux_loss_coef": 0.3, "checkpoint__at_end": False},
        "bias": {"model__moe__bias_update_rate": 0.05},
    }
    return {
        mode: train_in_process(root / mode, **BALANCE, model__moe__balance=mode, **fields)
        for mode, fields in modes.items()
    } | {"bias_dir": root / "bias"}


def test_balancing_evens_expert_load(balance_runs):
    """Unbalanced, the router sends tokens unevenly (cv of tokens per expert 0.69 over steps
    13-24 here); the aux loss (0.45) or the per-expert bias (0.30) keep the cv below 0.55 and
    at most 0.7 x the unbalanced run's."""
    cv = {mode: _last_cv(balance_runs[mode]) for mode in ("none", "aux", "bias")}
    assert cv["none"] > 0.6, cv
    for mode in ("aux", "bias"):
        assert cv[mode] < 0.55 and cv[mode] <= 0.7 * cv["none"], cv
    for mode in ("aux", "bias"):
        rows = [r for r in balance_runs[mode] if "moe_aux_loss" in r]
        assert all(r["moe_dropped_fraction"] == 0 for r in rows)  # dropless preset
        assert all(r["moe_load_min"] <= 1 <= r["moe_load_max"] for r in rows)
    # The aux loss measures the same imbalance (1.0 when even) and falls where it is trained.
    aux_loss = {
        m: [r for r in balance_runs[m] if "moe_aux_loss" in r][-1]["moe_aux_loss"]
        for m in ("none", "aux")
    }
    assert aux_loss["none"] > aux_loss["aux"]


def test_bias_is_checkpointed_and_generate_loads_it(balance_runs):
    from distrain.inference.generate import generate_text, load_model

    model, _ = load_model(balance_runs["bias_dir"], torch.device("cpu"))
    biases = [block.moe.expert_bias for block in model.blocks.values()]
    # 24 updates of +-0.05 (or 0 when an expert sits exactly at the mean): a multiple of 0.05.
    assert all(b.abs().max() > 0 for b in biases)
    for b in biases:
        steps = b / 0.05
        torch.testing.assert_close(steps, steps.round(), atol=1e-3, rtol=0)
    text = generate_text(
        balance_runs["bias_dir"], "def ", max_new_tokens=8, temperature=0.0, top_k=None, seed=0
    )
    assert text.startswith("def ") and len(text) > len("def ")
