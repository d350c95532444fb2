"""The GPT-2 family as the rest of distrain sees it: `GPT2_SPEC`, registered under "gpt2"
(models/registry.py). The module, its parallel plans, its pipeline cut and its init are the
shared decoder's (models/decoder/); the flavors, the fields it reads and the Hugging Face
adapter are GPT-2's own."""

from __future__ import annotations

from distrain.family.spec import HfAdapter
from distrain.models.decoder.spec import decoder_family
from distrain.models.gpt2.flavors import FIELDS, PRESETS
from distrain.models.gpt2.hf import gpt2_model_args, hf_config, hf_tensors, pretrained_source

GPT2_SPEC = decoder_family(
    "gpt2",
    presets=PRESETS,
    fields=FIELDS,
    from_hf=gpt2_model_args,
    hf=HfAdapter(source=pretrained_source, tensors=hf_tensors, config=hf_config),
)
