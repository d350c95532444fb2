"""Optimizers and the learning-rate schedule: AdamW (fused where the device has it), ZeRO-1 for
tp/pp layouts, and 1-bit Adam (plain, and sharded under ZeRO-1/2)."""
