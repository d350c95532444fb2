"""The planner: per-rank memory from the real build run on fake tensors under a fake process group
(memory.py), a step-time model with calibrated peak and bandwidths (timing.py, calibrate.py),
the ranked search over layouts (search.py, `distrain plan`), and the automatic micro-batch size
(auto_batch.py)."""
