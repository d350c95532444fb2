"""Parallel mechanisms applied to a plain model from outside: the device mesh and process groups
(mesh.py), data parallelism (DDP, FSDP2), tensor/sequence, pipeline, context and expert
parallelism, communication hooks, and `ParallelModel` (model.py), which applies a layout in one
fixed order and runs forward/backward the same way whatever the layout."""
