"""The Mixtral family: the shared decoder (models/decoder/) with a sparse mixture of experts in
every block (flavors.py), Mixtral's Hugging Face folders (hf.py), and the spec that hands them
to the rest of distrain (spec.py)."""
