"""Exporting a checkpoint to other tools' formats: a Hugging Face model folder and a torch.export
program (export.py). Reading Hugging Face folders is the model families' (models/hf_files.py and
each family's own mapping)."""
