"""The GPT-2 family (LayerNorm with biases, learned positions, a GELU MLP, biases in every
linear, a tied head) on the shared decoder (models/decoder/): its flavors (flavors.py), its
Hugging Face adapter (hf.py) and its spec (spec.py)."""
