"""What a model family is to the rest of distrain (spec.py), below both the families (models/)
and the mechanisms and consumers that read them."""
