"""Mixture-of-experts feed-forward layer: router, capacity, balancing losses and the expert MLPs.

No collectives live here. The experts are one module (`GroupedExperts`) holding every expert's
weights as stacked 3-D tensors and taking token rows already sorted by expert, so an expert-parallel
plan can wrap or replace `MoE.experts` from outside and shard dim 0 of its weights. The layer keeps
each forward call's statistics (balancing losses, tokens per expert, dropped copies) on itself as
device tensors for the trainer to collect; reading them never syncs the host.

Routing: a softmax router in fp32 picks top-k experts per token. With k > 1 the k gates are
renormalised to sum to 1 (Mixtral); with k = 1 the gate is the router probability itself (Switch),
since a renormalised top-1 gate is always 1 and would give the router no gradient from the loss.
With `capacity_factor` > 0 each expert takes at most ceil(cf * k * N / E) token copies of the N
tokens of this forward call; first choices of all tokens claim places before second choices, and
within a choice earlier tokens first (GShard's priority). A dropped copy contributes 0: the block's
residual carries the token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from distrain.torch_compat import is_fake


@dataclass(kw_only=True)
class MoEArgs:
    num_experts: int = 0
    """0 = a dense model."""
    top_k: int = 2
    every: int = 1
    """Block i holds an MoE layer when (i + 1) % every == 0; the others a dense MLP."""
    shared_experts: int = 0
    """Always-on experts, run as one dense MLP of shared_experts x ffn_dim (DeepSeek-MoE)."""
    ffn_dim: int = 0
    """Hidden size of one expert; 0 = the model's ffn_dim."""
    capacity_factor: float = 0.0
    """0 = dropless."""
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 0.0
    balance: Literal["aux", "bias", "none"] = "aux"
    """aux: Switch's load-balancing loss (x aux_loss_coef); bias: DeepSeek-V3's auxiliary-loss-
    free per-expert selection bias; none: neither (the aux loss is still measured)."""
    bias_update_rate: float = 1e-3

    @property
    def enabled(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, layer: int) -> bool:
        return self.enabled and (layer + 1) % self.every == 0

    def expert_ffn_dim(self, model_ffn_dim: int) -> int:
        return self.ffn_dim or model_ffn_dim

    def check(self, n_layers: int) -> None:
        if not self.enabled:
            return
        if self.top_k > self.num_experts:
            raise ValueError(
                f"moe.top_k ({self.top_k}) exceeds moe.num_experts ({self.num_experts}); "
                "lower top_k or add experts"
            )
        if self.every > n_layers:
            raise ValueError(
                f"moe.every ({self.every}) exceeds n_layers ({n_layers}): no block would hold "
                "an MoE layer; lower moe.every"
            )


class GroupedExperts(nn.Module):
    """num_experts expert MLPs as stacked 3-D weights.
    w_up: [E, dim, ffn_dim], w_down: [E, ffn_dim, dim]  (plus w_gate [E, dim, ffn_dim] if the MLP
    is gated). E is read from w_up.shape[0] at forward time, so expert parallelism can shard dim 0
    without touching this file."""

    def __init__(self, num_experts: int, dim: int, ffn_dim: int, *, gated: bool = False):
        super().__init__()
        self.w_up = nn.Parameter(torch.empty(num_experts, dim, ffn_dim))
        self.w_down = nn.Parameter(torch.empty(num_experts, ffn_dim, dim))
        self.w_gate = nn.Parameter(torch.empty(num_experts, dim, ffn_dim)) if gated else None

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """x: [N, dim] token rows sorted by expert (expert 0's rows first); num_tokens_per_expert:
        int64 [E] (sums to N). Returns [N, dim] in the same row order."""
        if _grouped_mm_usable(x, self.w_up):
            offsets = torch.cumsum(num_tokens_per_expert, 0, dtype=torch.int32)
            return self._grouped(x, offsets)
        return self._looped(x, num_tokens_per_expert)

    def _hidden(self, up: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        if gate is None:
            return F.gelu(up, approximate="tanh")
        return F.silu(gate) * up

    def _grouped(self, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        w_up, w_down, w_gate = (
            w.to(x.dtype) if w is not None else None for w in (self.w_up, self.w_down, self.w_gate)
        )
        up = torch._grouped_mm(x, w_up, offs=offsets)
        gate = torch._grouped_mm(x, w_gate, offs=offsets) if w_gate is not None else None
        return torch._grouped_mm(self._hidden(up, gate), w_down, offs=offsets)

    def _looped(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        # One matmul per expert. The split sizes must be host integers: on CPU reading them is
        # free; on an accelerator this path runs only where grouped_mm is missing (a sync).
        rows = torch.split(x, _split_sizes(x.shape[0], num_tokens_per_expert))
        outs = []
        for e, chunk in enumerate(rows):
            gate = chunk @ self.w_gate[e] if self.w_gate is not None else None
            outs.append(self._hidden(chunk @ self.w_up[e], gate) @ self.w_down[e])
        return torch.cat(outs)


def _split_sizes(num_rows: int, num_tokens_per_expert: torch.Tensor) -> list[int]:
    """The rows of each expert as host integers. A fake tensor (the planner's fake build,
    plan/memory.py) has no values to read: its rows are split evenly over the experts, which
    hold the same rows in all and price a balanced router."""
    if not is_fake(num_tokens_per_expert):
        return num_tokens_per_expert.tolist()
    experts = num_tokens_per_expert.shape[0]
    return [num_rows // experts + (e < num_rows % experts) for e in range(experts)]


def _within_capacity(
    order: torch.Tensor, position: torch.Tensor, capacity: int, num_experts: int
) -> torch.Tensor:
    """The copies of `order` whose place in their expert's queue (`position`) is within
    `capacity`. A fake tensor (the planner's fake build) has no positions to compare: the
    copies of a balanced router are kept, each expert's even share up to `capacity`, as
    `_split_sizes` prices them."""
    if not is_fake(position):
        return order[position < capacity]
    copies = order.shape[0]
    shares = [copies // num_experts + (e < copies % num_experts) for e in range(num_experts)]
    return order[: sum(min(share, capacity) for share in shares)].clone()


def _grouped_mm_usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """torch._grouped_mm runs on CUDA in bf16 (sm90+ kernels, with a fallback elsewhere); on CPU
    or in fp32 we loop over experts instead."""
    return (
        hasattr(torch, "_grouped_mm")
        and x.is_cuda
        and x.dtype == torch.bfloat16
        and weight.dtype in (torch.bfloat16, torch.float32)
    )


class MoE(nn.Module):
    """Routed experts (+ optional shared experts) in place of a block's dense MLP:
    [B, T, dim] -> [B, T, dim]. `shared` is built by the caller (the model's own dense MLP class)
    so shared experts are exactly the dense MLP of the model."""

    def __init__(
        self,
        dim: int,
        args: MoEArgs,
        ffn_dim: int,
        *,
        shared: nn.Module | None = None,
        gated: bool = False,
    ):
        super().__init__()
        self.args = args
        self.router = nn.Linear(dim, args.num_experts, bias=False)
        self.experts = GroupedExperts(args.num_experts, dim, ffn_dim, gated=gated)
        self.shared = shared
        # Added to the router's probabilities for choosing experts only (never to the gates);
        # moved after each step by the trainer from the load summed over data-parallel ranks.
        self.register_buffer("expert_bias", torch.zeros(args.num_experts), persistent=True)
        self.aux_loss: torch.Tensor | None = None
        self.z_loss: torch.Tensor | None = None
        self.tokens_per_expert: torch.Tensor | None = None
        self.dropped: torch.Tensor | None = None

    def balancing_loss(self) -> torch.Tensor:
        """The last forward call's loss term to add to the training loss (coefficients applied)."""
        assert self.aux_loss is not None and self.z_loss is not None, "no forward yet"
        loss = self.args.z_loss_coef * self.z_loss
        if self.args.balance == "aux":
            loss = loss + self.args.aux_loss_coef * self.aux_loss
        return loss

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        num_tokens, k = tokens.shape[0], self.args.top_k
        num_experts = self.router.weight.shape[0]
        logits = F.linear(tokens.float(), self.router.weight.float())
        probs = logits.softmax(dim=-1)
        scores = probs + self.expert_bias if self.args.balance == "bias" else probs
        chosen = scores.topk(k, dim=-1).indices  # [N, k]
        gates = probs.gather(-1, chosen)
        if k > 1:
            gates = gates / gates.sum(dim=-1, keepdim=True)

        # Copy j of the k*N is choice j // N of token j % N: all first choices come first.
        expert_of_copy = chosen.t().reshape(-1)
        # bincount's length depends on the values (fake tensors have none); this one is E.
        ones = torch.ones_like(expert_of_copy)
        counts = expert_of_copy.new_zeros(num_experts).scatter_add_(0, expert_of_copy, ones)
        order = torch.sort(expert_of_copy, stable=True).indices
        kept_counts = counts
        if self.args.capacity_factor > 0:
            capacity = math.ceil(self.args.capacity_factor * k * num_tokens / num_experts)
            starts = torch.cumsum(counts, 0) - counts
            position = torch.arange(order.numel(), device=x.device) - starts[expert_of_copy[order]]
            order = _within_capacity(order, position, capacity, num_experts)
            kept_counts = counts.clamp(max=capacity)
        token_of_copy = order % num_tokens
        out = self.experts(tokens[token_of_copy], kept_counts)
        weights = gates.t().reshape(-1)[order].unsqueeze(-1).to(out.dtype)
        combined = torch.zeros(num_tokens, out.shape[-1], dtype=out.dtype, device=out.device)
        combined.index_add_(0, token_of_copy, out * weights)
        combined = combined.view(*x.shape[:-1], -1)
        if self.shared is not None:
            combined = combined + self.shared(x)

        # Switch's loss: E * sum_i f_i * P_i, f = fraction of routed copies (before drops),
        # P = mean router probability; 1.0 when perfectly balanced.
        fraction = counts.float() / (k * num_tokens)
        self.aux_loss = num_experts * (fraction * probs.mean(dim=0)).sum()
        self.z_loss = torch.logsumexp(logits, dim=-1).square().mean()
        self.tokens_per_expert = counts.detach()
        self.dropped = counts.sum() - kept_counts.sum()
        return combined


def moe_layers(model: nn.Module) -> list[MoE]:
    """The MoE layers of a model (or of one pipeline stage), in block order."""
    return [m for m in model.modules() if isinstance(m, MoE)]
