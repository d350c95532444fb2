"""Other tools' formats: Hugging Face checkpoints (hf.py) and torch.export programs (export.py)."""
