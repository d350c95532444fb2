"""Observability: per-rank log files, metrics (JSONL + TensorBoard) and the rank-0 progress bar."""
