"""The Llama family (Llama 2 and Llama 3 / 3.1 / 3.2 shapes: grouped-query attention, SwiGLU,
RMSNorm, rotary positions with Llama 3's frequency scaling, tied or untied head) on the shared
decoder (models/decoder/): its flavors (flavors.py), its Hugging Face adapter (hf.py) and its
spec (spec.py)."""
