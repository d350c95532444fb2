"""Model families (one folder each: the plain module, its parallel plans, its Hugging Face
adapter), the registry of families by name, and the GPT's named presets."""

from distrain.models.gpt.model import GPT, ModelArgs, init_weights
from distrain.models.presets import PRESETS, flops_per_token, model_args, num_params
from distrain.models.registry import family_of, model_family, register_family

__all__ = [
    "GPT",
    "ModelArgs",
    "PRESETS",
    "family_of",
    "flops_per_token",
    "init_weights",
    "model_args",
    "model_family",
    "num_params",
    "register_family",
]
