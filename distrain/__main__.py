"""`python -m distrain` is the `distrain` command."""

from distrain.cli import program

program()
