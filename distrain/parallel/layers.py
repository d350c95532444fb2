"""Per-block transforms applied before data parallelism: activation checkpointing and compile.

Both act on each transformer block in place (the block's key in `model.blocks` is kept), so
parameter names, and so checkpoints and seeded init, are the same with or without them.
"""

from __future__ import annotations

from distrain.models.gpt import GPT
from distrain.torch_compat import checkpoint_wrapper


def apply_activation_checkpointing(model: GPT, mode: str, *, every: int) -> None:
    """none; full = recompute every block in backward; selective = every `every`-th block
    (layer-selective: trades some memory for less recompute)."""
    if mode == "none":
        return
    for key, block in list(model.blocks.items()):
        if mode == "full" or int(key) % every == 0:
            model.blocks[key] = checkpoint_wrapper(block, preserve_rng_state=False)


def apply_compile(model: GPT) -> None:
    """torch.compile each block (the repeated structure compiles once and is reused)."""
    for block in model.blocks.values():
        block.compile()
