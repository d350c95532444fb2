"""Seeding and RNG state: every RNG seeded from training.seed, and all of their states captured as
tensors so a checkpoint holds them without pickled Python objects."""

from __future__ import annotations

import os
import random

import numpy as np
import torch


def seed_everything(seed: int, *, deterministic: bool) -> None:
    """Same seed on every rank: model init and data order must not depend on the rank."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False


def rng_state() -> dict[str, torch.Tensor]:
    version, mt, gauss = random.getstate()
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "python": torch.tensor([version, *mt], dtype=torch.int64),
        "python_gauss": torch.tensor(
            [float("nan") if gauss is None else gauss], dtype=torch.float64
        ),
        "numpy": torch.tensor([*np_keys.tolist(), np_pos, np_has_gauss], dtype=torch.int64),
        "numpy_gauss": torch.tensor([np_gauss], dtype=torch.float64),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["torch"])
    py = state["python"].tolist()
    gauss = state["python_gauss"].item()
    random.setstate((py[0], tuple(py[1:]), None if gauss != gauss else gauss))
    np_vals = state["numpy"].tolist()
    np.random.set_state(
        (
            "MT19937",
            np.array(np_vals[:624], dtype=np.uint32),
            np_vals[624],
            np_vals[625],
            state["numpy_gauss"].item(),
        )
    )
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
