"""The Llama family as the rest of distrain sees it: `LLAMA_SPEC`, registered under "llama"
(models/registry.py). The module, its parallel plans, its pipeline cut and its init are the
shared decoder's (models/decoder/); the flavors, the fields it reads and the Hugging Face
adapter are Llama's own."""

from __future__ import annotations

from distrain.family.spec import HfAdapter
from distrain.models.decoder.spec import decoder_family
from distrain.models.llama.flavors import FIELDS, PRESETS
from distrain.models.llama.hf import hf_config, hf_tensors, llama_model_args, pretrained_source

LLAMA_SPEC = decoder_family(
    "llama",
    presets=PRESETS,
    fields=FIELDS,
    from_hf=llama_model_args,
    hf=HfAdapter(source=pretrained_source, tensors=hf_tensors, config=hf_config),
)
