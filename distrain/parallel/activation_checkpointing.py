"""Activation checkpointing, applied before data parallelism: full, layer-selective or op-level
selective recompute of the model's blocks in backward.

It wraps a model's repeated blocks (the `nn.ModuleDict` its family's spec names,
family/spec.py) and acts in place (a wrapped block keeps its key among the blocks), so
parameter names, and so checkpoints and seeded init, are the same with or without it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from distrain.torch_compat import checkpoint_wrapper

# What op-level selective checkpointing keeps from the forward: the outputs of the expensive
# ops (matmuls and attention, O(n^3)-ish work per element saved) and of collectives (recomputing
# one would send it again, and under tp/sp every rank would have to repeat it in step). All
# other ops (norms, activations, rotary, adds, views) are recomputed: cheap per byte they would
# hold. The attention entries cover CPU, CUDA's flash / memory-efficient / cuDNN kernels.
_SAVED_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    torch.ops._c10d_functional.all_gather_into_tensor.default,
    torch.ops._c10d_functional.all_reduce.default,
}


def _save_expensive_ops(_ctx: Any, op: Any, *_args: Any, **_kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def selective_op_contexts() -> tuple[Any, Any]:
    """The forward/recompute context pair of one op-level selective checkpoint (a fresh pair per
    call, as torch.utils.checkpoint requires)."""
    return create_selective_checkpoint_contexts(_save_expensive_ops)


def apply_activation_checkpointing(blocks: nn.ModuleDict, mode: str, *, every: int) -> None:
    """Wrap a model's `blocks` (keyed "0".."n-1") in place. none; full = recompute every block
    in backward; selective = every `every`-th block (layer-selective: trades some memory for
    less recompute); selective_op = every block, but only the cheap ops are recomputed
    (`_SAVED_OPS` are kept)."""
    if mode == "none":
        return
    context_fn = selective_op_contexts if mode == "selective_op" else None
    for key, block in list(blocks.items()):
        if mode in ("full", "selective_op") or int(key) % every == 0:
            blocks[key] = checkpoint_wrapper(block, preserve_rng_state=False, context_fn=context_fn)
