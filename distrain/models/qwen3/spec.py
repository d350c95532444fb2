"""The Qwen3 family as the rest of distrain sees it: `QWEN3_SPEC`, registered under "qwen3"
(models/registry.py). The module, its parallel plans, its pipeline cut and its init are the
shared decoder's (models/decoder/); the flavors, the fields it reads and the Hugging Face
adapter are Qwen3's own."""

from __future__ import annotations

from distrain.family.spec import HfAdapter
from distrain.models.decoder.spec import decoder_family
from distrain.models.qwen3.flavors import FIELDS, PRESETS
from distrain.models.qwen3.hf import hf_config, hf_tensors, pretrained_source, qwen3_model_args

QWEN3_SPEC = decoder_family(
    "qwen3",
    presets=PRESETS,
    fields=FIELDS,
    from_hf=qwen3_model_args,
    hf=HfAdapter(source=pretrained_source, tensors=hf_tensors, config=hf_config),
)
