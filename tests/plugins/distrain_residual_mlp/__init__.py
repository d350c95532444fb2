"""A model family that lives outside distrain, as a user's would: a residual MLP language model,
in one folder (model.py, parallelize.py, spec.py), found by distrain through the
`distrain.model_families` entry point its distribution declares (tests/test_family_plugin.py
installs that entry point for a test run). Not a GPT: its block and submodule names, seeded
init, tensor-parallel plan and pipeline cut are its own."""
