"""Checkpoints: the sharded save/commit/resume protocol (checkpointer.py) over the step folders
and manifests it commits (manifest.py), when to save (policy.py), safe loading of checkpoints
that may be hostile (load.py, metadata.py), and the storage they live on (a local folder or an
fsspec object store)."""
