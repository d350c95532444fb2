"""Model families, one folder each (models/<family>/: the plain module, its parallel plans, its
Hugging Face adapter, its flavors and counts, and the `ModelSpec` that hands them on), and the
registry of families by name (registry.py). Reading a Hugging Face folder, whatever the
family, is hf_files.py's; the mixture-of-experts layer families share is moe.py's."""
