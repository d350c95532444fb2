"""The Mixtral family as the rest of distrain sees it: `MIXTRAL_SPEC`, registered under
"mixtral" (models/registry.py). The module, its parallel plans (expert parallelism included),
its pipeline cut and its init are the shared decoder's (models/decoder/); the flavors, the
fields it reads and the Hugging Face adapter are Mixtral's own."""

from __future__ import annotations

from distrain.family.spec import HfAdapter
from distrain.models.decoder.spec import decoder_family
from distrain.models.mixtral.flavors import FIELDS, PRESETS
from distrain.models.mixtral.hf import hf_config, hf_tensors, mixtral_model_args, pretrained_source

MIXTRAL_SPEC = decoder_family(
    "mixtral",
    presets=PRESETS,
    fields=FIELDS,
    from_hf=mixtral_model_args,
    hf=HfAdapter(source=pretrained_source, tensors=hf_tensors, config=hf_config),
)
