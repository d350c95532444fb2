"""`python -m distrain` is the `distrain` command."""

import sys

from distrain.cli import main

sys.exit(main())
