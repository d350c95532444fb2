"""The gpt family as the rest of distrain sees it: `GPT_SPEC`, registered under "gpt" (the
default `model.family`; models/registry.py). The module, its parallel plans, its pipeline cut
and its init are the shared decoder's (models/decoder/); its flavors and the fields it reads
(all of the decoder's settings) are its own. It reads and writes no Hugging Face folder."""

from __future__ import annotations

from distrain.models.decoder.spec import decoder_family
from distrain.models.gpt.flavors import FIELDS, PRESETS

GPT_SPEC = decoder_family("gpt", presets=PRESETS, fields=FIELDS, from_hf=None, hf=None)
