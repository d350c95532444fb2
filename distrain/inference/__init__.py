"""Using a trained checkpoint: text sampling (`distrain generate`)."""
