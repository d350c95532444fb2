"""The decoder-only transformer the built-in families share: the plain module (model.py), its
mixture-of-experts layer (moe.py), its parallel plans (parallelize.py), its parameter and FLOP
counts (counts.py), its arguments from the `[model]` section (args.py), its reading of a
family's Hugging Face tensors (pretrained.py) and the spec every family on it starts from
(spec.py). A family (gpt, llama, gpt2, qwen3, mixtral) is its own folder next to this one: its
flavors, the fields it reads and its Hugging Face adapter."""
