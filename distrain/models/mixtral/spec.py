"""The Mixtral family as the rest of distrain sees it: `MIXTRAL_SPEC`, registered under
"mixtral" (models/registry.py). The module, its parallel plans (expert parallelism included),
its pipeline cut and its init are the decoder's of models/gpt/ (its spec's); the flavors, the
fields it reads and the Hugging Face adapter are Mixtral's own."""

from __future__ import annotations

import dataclasses

from distrain.family.spec import HfAdapter
from distrain.models.gpt.spec import GPT_SPEC
from distrain.models.mixtral.flavors import FIELDS, PRESETS, mixtral_args
from distrain.models.mixtral.hf import hf_config, hf_tensors, pretrained_source

MIXTRAL_SPEC = dataclasses.replace(
    GPT_SPEC,
    name="mixtral",
    presets=PRESETS,
    config_fields=FIELDS,
    args_from_config=mixtral_args,
    hf=HfAdapter(source=pretrained_source, tensors=hf_tensors, config=hf_config),
)
