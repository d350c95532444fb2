"""The gpt family: the shared decoder (models/decoder/) with every setting open, its flavors
(flavors.py) and its spec (spec.py)."""
