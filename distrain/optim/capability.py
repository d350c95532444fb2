"""What an optimizer takes over from the data-parallel layer under a layout: its
`OptimizerCapability`, declared per optimizer (`optimizer_capability`) from the config alone, so
that the layout rules and the mesh ask it before any optimizer exists. What changes from step to
step (warm-up or compressed) the built optimizers answer at run time (gradient_step.py)."""

from __future__ import annotations

from dataclasses import dataclass

from distrain.config.schema import OptimConfig
from distrain.parallel.compress import onebit_blocks


@dataclass(frozen=True, kw_only=True)
class OptimizerCapability:
    exchanges_momentum: bool = False
    """Past a warm-up the optimizer sends its momentum over the data-parallel ranks instead of
    the gradients: nothing else may reduce or hook the gradients in backward (no ZeRO-3, DDP
    communication hook, expert parallelism or OOM retry)."""
    shards_state: bool = False
    """It shards its own state over the data-parallel ranks (ZeRO-1/2 in owner chunks)."""
    averages_gradients: bool = False
    """No data-parallel wrapper: it averages the local gradients itself in warm-up (its DTensor
    shards and pipeline stages as local tensors, under tp or pp)."""
    shards_gradients: bool = False
    """No data-parallel wrapper: it reduce-scatters the local gradients to the owners of its
    chunks and clips through that reduce (ZeRO-2); the parameters stay whole on every
    data-parallel rank."""

    @property
    def replaces_wrapper(self) -> bool:
        """It averages the data-parallel gradients itself: neither DDP nor FSDP2 wraps the model
        (`ParallelDims.dp_wrapper` "optimizer")."""
        return self.averages_gradients or self.shards_gradients


ADAMW = OptimizerCapability()
"""AdamW, plain or ZeRO-1, and SGD: the wrapper (DDP, FSDP2) averages the gradients in
backward."""


def optimizer_capability(
    optim: OptimConfig, *, zero_stage: int, tp: int, pp: int
) -> OptimizerCapability:
    """The capability `optim` declares under ZeRO stage `zero_stage` with degrees tp and pp."""
    if optim.name in ("adamw", "sgd"):
        return ADAMW
    # 1-bit Adam (onebit_adam.py; under ZeRO-1/2 onebit_zero.py).
    return OptimizerCapability(
        exchanges_momentum=True,
        shards_state=zero_stage in (1, 2),
        averages_gradients=zero_stage == 0 and (tp > 1 or pp > 1),
        shards_gradients=zero_stage == 2,
    )


def held_state_bytes(numel: int, world: int) -> int:
    """Bytes of state a rank of sharded 1-bit Adam (onebit_zero.py, ZeRO-1/2) holds past warm-up
    for `numel` parameter values over `world` ranks, declared here for the planner, which counts
    it without building the optimizer: its chunk of the momentum, the variance and the server
    error, and, whole, its worker error and the frozen denominator, all fp32."""
    blocks, block = onebit_blocks(numel, world)
    chunk = blocks * block
    return 4 * (3 * chunk + 2 * world * chunk)
