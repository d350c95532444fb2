"""Model definitions (plain modules, no parallel code) and their named presets."""

from distrain.models.gpt import GPT, ModelArgs, init_weights
from distrain.models.presets import PRESETS, flops_per_token, model_args, num_params

__all__ = [
    "GPT",
    "ModelArgs",
    "PRESETS",
    "flops_per_token",
    "init_weights",
    "model_args",
    "num_params",
]
