"""Training: the worker entry (`python -m distrain.train`), the loop, what a checkpoint holds of
the training state, the automatic micro-batch size, out-of-memory recovery and fault injection."""
