"""Optimizer construction and the learning-rate schedule.

The schedule (linear warmup, cosine decay to min_lr_ratio * lr) is a pure function of the step,
so a checkpoint's step is all it needs to resume exactly.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from distrain.config import OptimConfig


def lr_at(step: int, *, cfg: OptimConfig, total_steps: int) -> float:
    """Learning rate for optimizer step `step` (0-based)."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    decay_steps = max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    min_lr = cfg.lr * cfg.min_lr_ratio
    return min_lr + 0.5 * (cfg.lr - min_lr) * (1 + math.cos(math.pi * progress))


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices only: norms, biases and embedding tables stay undecayed (GPT-2 practice)."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if param.ndim < 2 or "emb" in name:
            no_decay.append(param)
        else:
            decay.append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_optimizer(
    model: nn.Module, cfg: OptimConfig, *, zero1_group: dist.ProcessGroup | None = None
) -> torch.optim.Optimizer:
    """AdamW; with `zero1_group` (ZeRO stage 1) its state is partitioned across that group by
    torch's ZeroRedundancyOptimizer, each rank updating its share and broadcasting it."""
    # foreach=True keeps the update a handful of fused kernels on GPU and CPU alike.
    options = {"lr": cfg.lr, "betas": (cfg.beta1, cfg.beta2), "eps": cfg.eps, "foreach": True}
    groups = param_groups(model, cfg.weight_decay)
    if zero1_group is None:
        return torch.optim.AdamW(groups, **options)
    from torch.distributed.optim import ZeroRedundancyOptimizer  # slow import: only when used

    zero = ZeroRedundancyOptimizer(
        groups[0]["params"],
        optimizer_class=torch.optim.AdamW,
        process_group=zero1_group,
        weight_decay=groups[0]["weight_decay"],
        **options,
    )
    zero.add_param_group(groups[1])
    return zero


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
