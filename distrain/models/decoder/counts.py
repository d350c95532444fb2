"""The decoder's exact parameter count and training FLOPs per token, from its arguments alone
(no model instance: a 70B plan costs nothing to compute)."""

from __future__ import annotations

from distrain.models.decoder.model import ModelArgs


def num_params(args: ModelArgs) -> int:
    """Exact parameter count of Decoder(args), counting a tied embedding once."""
    bias = args.bias
    # RMSNorm: a weight vector; LayerNorm: also a bias vector when the model has biases.
    norm = args.dim * (2 if bias and args.norm == "layernorm" else 1)
    kv_dim, q_dim = args.kv_heads * args.head_dim, args.q_dim
    attn = 2 * args.dim * (q_dim + kv_dim) + bias * (q_dim + 2 * kv_dim + args.dim)
    attn += 2 * args.head_dim * args.qk_norm  # the query and key heads' RMSNorm weights
    mlp = _mlp_params(args, args.ffn_dim)
    block = attn + mlp + 2 * norm
    total = args.vocab_size * args.dim + args.n_layers * block + norm
    if args.pos_emb == "learned":
        total += args.max_seq_len * args.dim
    if not args.tie_embeddings:
        total += args.vocab_size * args.dim
    return total + _moe_layers(args) * (_moe_params(args, active=False) - mlp)


def _mlp_params(args: ModelArgs, ffn_dim: int) -> int:
    """One dense MLP of width ffn_dim: two matrices (gelu) or three (swiglu), and biases."""
    matrices = 3 if args.mlp == "swiglu" else 2
    return matrices * args.dim * ffn_dim + args.bias * ((matrices - 1) * ffn_dim + args.dim)


def _moe_layers(args: ModelArgs) -> int:
    return sum(args.moe.is_moe_layer(i) for i in range(args.n_layers))


def _moe_params(args: ModelArgs, *, active: bool) -> int:
    """Parameters of one MoE layer (router, experts, shared experts); with active, only those
    one token uses: the router, its top_k experts and the shared experts."""
    moe = args.moe
    ffn_dim = moe.expert_ffn_dim(args.ffn_dim)
    experts = moe.top_k if active else moe.num_experts
    shared = _mlp_params(args, moe.shared_experts * ffn_dim) if moe.shared_experts else 0
    return args.dim * moe.num_experts + experts * _expert_params(args) + shared


def _expert_params(args: ModelArgs) -> int:
    """One routed expert: two matrices (gelu) or three (swiglu), without biases."""
    matrices = 3 if args.mlp == "swiglu" else 2
    return matrices * args.dim * args.moe.expert_ffn_dim(args.ffn_dim)


def routed_expert_params(args: ModelArgs) -> int:
    """Parameters of the routed experts of every MoE layer (what expert parallelism splits)."""
    return _moe_layers(args) * args.moe.num_experts * _expert_params(args)


def active_params(args: ModelArgs) -> int:
    """Parameters one token's forward uses: num_params less the experts it is not routed to."""
    inactive = _moe_params(args, active=False) - _moe_params(args, active=True)
    return num_params(args) - _moe_layers(args) * inactive


def flops_per_token(args: ModelArgs, seq_len: int) -> float:
    """Training FLOPs per token, forward + backward: 6 per matmul weight a token uses (MoE: the
    router and its top_k experts) plus attention's 12 L T d (PaLM's accounting; d the heads'
    total width). Embedding lookups are not matmuls; the output projection is."""
    lookups = args.max_seq_len * args.dim if args.pos_emb == "learned" else 0
    if not args.tie_embeddings:
        lookups += args.vocab_size * args.dim
    return 6 * (active_params(args) - lookups) + 12 * args.n_layers * seq_len * args.q_dim
