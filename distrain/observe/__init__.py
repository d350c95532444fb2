"""Observability: per-rank log files, metrics (JSONL + TensorBoard), the rank-0 progress bar,
numerical health, stragglers, profiling, heartbeats and the hang watchdog (with torch's flight
recorder), and the commands that read a run dir afterwards (`distrain status`, `diagnose`,
`plot`)."""
