"""distrain: train transformer models across many processes and machines on torch.distributed."""

__version__ = "0.1.0"
