"""Applying a parallel layout to a plain model, in one fixed order.

build on meta -> (later: pipeline split, tensor parallel, activation checkpointing, compile)
-> materialize + seeded init -> data parallel wrap. The model module itself never changes.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from distrain.config import Config
from distrain.mesh import ParallelDims
from distrain.models.gpt import GPT, ModelArgs, init_weights
from distrain.parallel.data import apply_ddp


def build_parallel_model(
    args: ModelArgs, cfg: Config, dims: ParallelDims, mesh: DeviceMesh, device: torch.device
) -> tuple[nn.Module, GPT]:
    """Returns (the module to train, the plain GPT inside it for saving and evaluation)."""
    with torch.device("meta"):
        model = GPT(args)
    model.to_empty(device=device)
    init_weights(model, cfg.training.seed)
    wrapped = apply_ddp(
        model, mesh["dp_replicate"], bucket_cap_mb=cfg.comm.bucket_cap_mb, device=device
    )
    return wrapped, model
