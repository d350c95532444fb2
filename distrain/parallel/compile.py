"""torch.compile, applied before data parallelism, with a persistent cache of compiled kernels.

It acts in place (a compiled module keeps its own key), so parameter names, and so checkpoints
and seeded init, are the same with or without it.
"""

from __future__ import annotations

import os
from pathlib import Path

from torch import nn


def compile_cache_dir() -> Path:
    """Where compiled kernels persist between runs: the user's cache dir (XDG_CACHE_HOME, else
    ~/.cache)/distrain/torch-compile. Inductor's default, a folder under /tmp, does not outlive
    a reboot or a fresh container, so every such run would pay the cold compile again."""
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "distrain" / "torch-compile"


def use_persistent_compile_cache() -> Path:
    """Point inductor's on-disk caches (FX graphs, AOT autograd, and Triton kernels on CUDA,
    all keyed by graph, torch version and device) at `compile_cache_dir()`, unless the user set
    TORCHINDUCTOR_CACHE_DIR; inductor reads it when it first compiles. Returns the folder."""
    folder = os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(compile_cache_dir()))
    return Path(folder)


def apply_compile(model: nn.Module, *, whole: bool, blocks: nn.ModuleDict) -> None:
    """torch.compile the whole model as one graph (`whole`: no hook or wrapper inside it that
    compiling across blocks would trace: a plain or DDP layout), else each of its `blocks` (the
    repeated structure compiles once and is reused; FSDP2, tp, pp, cp and activation
    checkpointing act per block). Compiled kernels persist across runs
    (`use_persistent_compile_cache`)."""
    use_persistent_compile_cache()
    if whole:
        model.compile(fullgraph=True)
        return
    for block in blocks.values():
        block.compile()
