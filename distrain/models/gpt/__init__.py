"""The GPT family: the plain module (model.py), its parallel plans (parallelize.py), its Hugging
Face adapter (hf.py), its flavors (flavors.py), its counts (counts.py) and the spec that hands
them to the rest of distrain (spec.py)."""

from distrain.models.gpt.counts import active_params, flops_per_token, num_params
from distrain.models.gpt.flavors import PRESETS
from distrain.models.gpt.model import GPT, ModelArgs, init_weights
from distrain.models.gpt.spec import GPT_SPEC

__all__ = [
    "GPT",
    "GPT_SPEC",
    "PRESETS",
    "ModelArgs",
    "active_params",
    "flops_per_token",
    "init_weights",
    "num_params",
]
