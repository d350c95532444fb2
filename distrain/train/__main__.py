"""`python -m distrain.train [options]`: one worker (see worker.py)."""

import gc
import sys

from distrain.train.worker import main

if __name__ == "__main__":
    # What the imports made lives as long as the worker: kept out of the collector's full
    # passes, which would otherwise walk torch's hundreds of thousands of objects each time.
    # Here, once per process, not in main(): a process running several trainings in turn (the
    # tests' pooled worker) would otherwise freeze each one's leftovers for good.
    gc.freeze()
    sys.exit(main())
