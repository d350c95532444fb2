"""The planner: per-rank memory from the real build run on fake tensors under a fake process group
(memory.py; pipeline_memory.py for pp), a step-time model of a cluster from FLOPs and bandwidths
(timing.py), this machine's measured matmul rate and collective costs (calibrate.py,
collectives.py), the step time of a layout small enough to probe here (probe.py), and the ranked
search over layouts (search.py) behind `distrain plan` (command.py). The automatic micro-batch
size is train/autobatch.py, which measures on the real build."""
