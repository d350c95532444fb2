"""The GPT family: the plain module (model.py), its parallel plans (parallelize.py), its Hugging
Face adapter (hf.py) and the spec that hands them to the parallel mechanisms (spec.py)."""
