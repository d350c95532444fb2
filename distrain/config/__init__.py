"""The run configuration: its schema (typed dataclasses with a help text and a range per field),
reading it from TOML and command-line overrides, and the `train` argument parser."""
