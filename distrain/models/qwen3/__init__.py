"""The Qwen3 family: the shared decoder (models/decoder/) with each attention head's queries
and keys RMS-normalized and heads of their own width (flavors.py), Qwen3's Hugging Face
folders (hf.py), and the spec that hands them to the rest of distrain (spec.py)."""
