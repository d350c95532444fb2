"""Worker of tests/batch.py: under torchrun, trains each run of a batch in turn, each in a
process group of its own, and writes every run's outcome on this rank as a JSON line.

`python batch_worker.py SPEC.json`: SPEC holds `runs` (each a `name` and the `argv` that
`python -m distrain.train` would get) and `status_dir`. A run goes through distrain's own worker
entry (`distrain.train.worker.main`: argument parsing, validation, run_training and its
teardown); only
the process group is made here, on a prefix of torchrun's store named after the run, so that
each run's rendezvous keys are its own. The first failure ends the process (torchrun then stops
the other ranks, which may wait in a collective of the failed run): the launcher starts the runs
after it in a new batch.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from distrain.config.args import parse_train_args
from distrain.parallel.device import collective_timeout, pick_device
from distrain.train.worker import main as train_main


def run_one(argv: list[str], name: str, store: dist.Store, rank: int, world_size: int) -> None:
    """Train one run of the batch; raises if it failed on this rank."""
    _, cfg = parse_train_args(argv, worker=True)
    _, backend = pick_device(cfg.run.device, int(os.environ.get("LOCAL_RANK", 0)))
    # Not helpers.process_group: the group a distrain worker makes for itself (the run's
    # backend and timeout, on torchrun's store), handed over to run_training.
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(f"{name}/", store),
        rank=rank,
        world_size=world_size,
        timeout=collective_timeout(cfg.comm.collective_timeout_s),
    )
    # run_training joins the group made above and destroys it at its end, failed or not.
    # training.deterministic turns torch's process-wide deterministic mode on: the next run
    # starts in the mode a process of its own would.
    deterministic = torch.are_deterministic_algorithms_enabled()
    try:
        code = train_main(argv)
    finally:
        torch.use_deterministic_algorithms(deterministic)
    if code != 0:
        raise RuntimeError(f"distrain.train exited with {code} (its error is on stderr)")
    if dist.is_initialized():
        raise RuntimeError("run_training left its process group behind")


def main(spec_path: str) -> int:
    # Torch and distrain, imported, live as long as this process: out of the cyclic GC's sight,
    # the full collections of many runs (run_training's teardown does one per run) scan only
    # what each run made (6 runs of 2 ranks, loaded machine: the GC's CPU 2.15 -> 0.11 s a
    # rank).
    gc.freeze()
    spec = json.loads(Path(spec_path).read_text())
    store, rank, world_size = next(dist.rendezvous("env://"))
    status = Path(spec["status_dir"]) / f"rank{rank}.jsonl"
    for run in spec["runs"]:
        try:
            run_one(run["argv"], run["name"], store, rank, world_size)
        except BaseException:
            line = {"name": run["name"], "ok": False, "error": traceback.format_exc()}
            with status.open("a") as f:
                f.write(json.dumps(line) + "\n")
            return 1
        with status.open("a") as f:
            f.write(json.dumps({"name": run["name"], "ok": True}) + "\n")
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1])
    sys.stdout.flush()
    sys.stderr.flush()
    # A failed run may leave threads of its process group blocked: end without joining them.
    os._exit(code)
