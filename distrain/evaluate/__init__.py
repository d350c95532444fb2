"""Downstream evaluation: `distrain eval` runs lm-evaluation-harness tasks on a run's checkpoint
(any layout's) through an LM wrapper over distrain's own model and tokenizer."""
