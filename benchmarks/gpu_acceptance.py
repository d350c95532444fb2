"""The GPU acceptance run: one command, one GPU, at most 8 minutes, one JSON record.

Five stages, each a bounded step (its own time budget, and never past the run's deadline), each
writing its part of one record; a stage that fails or runs out of time is recorded with its error
and the run goes on; the exit status is 1 if any stage failed.

1. cuda_tests: every test marked `requires("cuda")` (collected by marker: tests/conftest.py's
   --requires-only), strict (DISTRAIN_REQUIRE=cuda: a skip is a failure), then the old subset's
   files (NVTX ranges and the profiler, training.precision auto -> bf16).
2. throughput: benchmarks/mfu.py on a ~1B Llama (llama3-1b) and a ~1B-class Qwen3 (qwen3-0.6b),
   bf16, seq 2048, one GPU: eager and compiled x activation checkpointing none and full; the
   micro-batch is the largest of 8, 4, 2, 1 that fits the first variant (eager, none). Tokens/s,
   MFU against the datasheet's dense bf16 peak, and `torch.cuda.max_memory_allocated` per row.
3. checkpoint: benchmarks/checkpoint.py on one GPU: the stall of a background save (thread mode,
   staged into pinned host memory) against the synchronous save, same model and steps.
4. planner_memory: benchmarks/plan_gpu.py --compare prices stage 2's eager rows (same preset,
   activation checkpointing, micro-batch, seq) as `distrain plan` does and records its error
   against the rows' `max_memory_allocated`.
5. trace: a short `distrain train` run with the profiler on; its Chrome trace is checked for
   distrain's phase ranges (distrain/forward, ...), on the host and on the GPU's timeline. Where
   Nsight Systems (`nsys`) is installed, a second run under it checks the NVTX ranges themselves.

--dry-run (CPU, CI): the same stages with tiny presets and few steps, eager only (compiling on
CI's 2 cores costs more than the run), writing gpu-dry-run.json instead; what needs CUDA (the CUDA
tests run, the GPU's memory peak, ranges on the GPU timeline) is recorded "skipped: no CUDA".

    python3 benchmarks/gpu_acceptance.py             # on the GPU machine (benchmarks/gpu.sh)
    python3 benchmarks/gpu_acceptance.py --dry-run   # anywhere
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# From the source tree, installed or not: this process and every command it starts.
sys.path.insert(1, str(ROOT))
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))

import torch  # noqa: E402
from harness import write_json  # noqa: E402

# The whole run's budget on one GPU, and each stage's (they sum to a little under it).
RUN_BUDGET_S = 480.0
SKIPPED = "skipped: no CUDA"
# The subset the GPU check ran before the tests were collected by marker.
OLD_SUBSET = [
    "tests/test_compress.py::test_comm_clock_on_cuda_measures_the_stream_not_the_launch",
    "tests/test_profiling.py",
    "tests/test_precision.py",
]
PHASES = ("data", "forward", "backward", "optimizer")


@dataclass
class Sizes:
    """What each stage runs: the GPU run's sizes, or the dry run's tiny ones."""

    models: tuple[str, ...]
    seq_len: int
    micro_batches: str
    warmup: int
    steps: int
    variants: str
    checkpointing: str
    checkpoint_preset: str
    checkpoint_micro_batch: int
    checkpoint_rounds: int
    trace_preset: str
    # Seconds per command, named stage[:part] (throughput: one per model).
    budgets: dict[str, float] = field(default_factory=dict)
    peak_tflops: float | None = None


GPU = Sizes(
    models=("llama3-1b", "qwen3-0.6b"),
    seq_len=2048,
    micro_batches="8,4,2,1",
    warmup=3,
    steps=5,
    variants="eager,compiled",
    checkpointing="none,full",
    checkpoint_preset="qwen3-0.6b",
    checkpoint_micro_batch=1,
    checkpoint_rounds=2,
    trace_preset="llama3-1b",
    budgets={
        "cuda_tests": 35,
        "cuda_tests:subset": 20,
        "throughput:llama3-1b": 140,
        "throughput:qwen3-0.6b": 120,
        "checkpoint": 50,
        "planner_memory": 40,
        "trace": 30,
        "trace:nsys": 30,
    },
)
DRY = Sizes(
    models=("llama-tiny", "qwen3-tiny"),
    seq_len=32,
    micro_batches="4,2",
    warmup=1,
    steps=2,
    variants="eager",
    checkpointing="none,full",
    checkpoint_preset="tiny",
    checkpoint_micro_batch=2,
    checkpoint_rounds=1,
    trace_preset="llama-tiny",
    budgets={
        "cuda_tests": 120,
        "cuda_tests:subset": 60,
        "throughput:llama-tiny": 90,
        "throughput:qwen3-tiny": 90,
        "checkpoint": 90,
        "planner_memory": 90,
        "trace": 90,
        "trace:nsys": 60,
    },
    # Measuring a CPU's bf16 matmul peak takes minutes without AMX: MFU against the H200's.
    peak_tflops=989,
)
DRY_NOTES = [
    "dry run on CPU: tiny presets, few steps; figures say nothing about a GPU",
    "no compiled variants: compiling on CI's 2 cores costs more than the whole run",
    "MFU against --peak-tflops 989 (an H200's dense bf16 peak), not this CPU's",
]


class StageError(Exception):
    """A stage's failure, with what it measured before failing."""

    def __init__(self, message: str, result: dict[str, Any] | None = None):
        super().__init__(message)
        self.result = result or {}


class Run:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.cuda = torch.cuda.is_available()
        self.sizes = DRY if args.dry_run else GPU
        self.start = time.monotonic()
        self.deadline = self.start + args.budget_s
        self.work = Path(args.work_dir or tempfile.mkdtemp(prefix="distrain-gpu-acceptance-"))
        self.work.mkdir(parents=True, exist_ok=True)
        self.out = Path(args.out_dir) / (
            "gpu-dry-run.json" if args.dry_run else "gpu-acceptance.json"
        )
        self.record: dict[str, Any] = {
            "kind": "dry run (CPU)" if args.dry_run else "GPU acceptance run",
            "device": torch.cuda.get_device_name(0) if self.cuda else "CPU",
            "device_count": torch.cuda.device_count() if self.cuda else 0,
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "budget_s": args.budget_s,
            "notes": list(DRY_NOTES) if args.dry_run else [],
            "work_dir": str(self.work),
            "stages": {},
        }

    def budget(self, name: str) -> float:
        """Seconds the command `name` may take: its budget, never past the run's deadline."""
        return max(min(self.sizes.budgets[name], self.deadline - time.monotonic()), 0.0)

    def command(
        self, name: str, argv: list[str], *, env: dict[str, str] | None = None
    ) -> tuple[int, str]:
        """Run `argv` from the repository root within `name`'s budget; its output goes to
        <work>/<name>.log. Returns the exit status (124 when out of time) and the output's tail.
        On timeout the process group gets SIGTERM (torchrun stops its ranks), then SIGKILL."""
        log = self.work / f"{name.replace(':', '-')}.log"
        timeout = self.budget(name)
        if timeout <= 0:
            return 124, "no time left in the run's budget"
        print(f"== {name} ({timeout:.0f} s at most): {' '.join(argv)}", flush=True)
        with log.open("w") as out:
            proc = subprocess.Popen(
                argv,
                cwd=ROOT,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, **(env or {})},
                start_new_session=True,
            )
            try:
                code = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                _stop_group(proc)
                code = 124
        text = log.read_text(errors="replace")
        if code == 124:
            text += f"\n[stopped after its budget of {timeout:.0f} s]"
        return code, text[-3000:]

    def stage(self, name: str, body: Callable[[], dict[str, Any]]) -> None:
        started = time.monotonic()
        entry: dict[str, Any] = {"status": "ok"}
        try:
            result = body()
            entry["status"] = result.pop("status", "ok")
            entry["result"] = result
        except Exception as e:  # noqa: BLE001 - recorded; the run goes on
            entry["status"] = "error"
            entry["error"] = f"{type(e).__name__}: {e}"[-4000:]
            if isinstance(e, StageError) and e.result:
                entry["result"] = e.result
        entry["wall_s"] = round(time.monotonic() - started, 1)
        self.record["stages"][name] = entry
        print(f"== {name}: {entry['status']} in {entry['wall_s']} s", flush=True)
        self.write()

    def write(self) -> None:
        self.record["wall_s"] = round(time.monotonic() - self.start, 1)
        self.record["failed"] = [
            n for n, s in self.record["stages"].items() if s["status"] == "error"
        ]
        write_json(self.out, self.record)

    def python(self, script: str, *argv: object) -> list[str]:
        return [sys.executable, script, *map(str, argv)]

    # -- stage 1 ------------------------------------------------------------------------------

    def cuda_tests(self) -> dict[str, Any]:
        pytest = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider"]
        marked_xml, subset_xml = self.work / "cuda-tests.xml", self.work / "subset-tests.xml"
        if not self.cuda:
            # The marked tests skip here (the skip a strict run allows); the subset is collected.
            code, tail = self.command(
                "cuda_tests",
                [*pytest, "--requires-only", "cuda", f"--junitxml={marked_xml}", "tests/"],
            )
            marked = _junit(marked_xml)
            if code != 0 or marked["tests"] == 0 or marked["skipped"] != marked["tests"]:
                raise StageError(f"pytest exit {code}: {tail}", {"requires_cuda": marked})
            code, tail = self.command("cuda_tests:subset", [*pytest, "--collect-only", *OLD_SUBSET])
            if code != 0:
                raise StageError(f"collecting {OLD_SUBSET}: exit {code}: {tail}")
            return {"status": SKIPPED, "requires_cuda": marked, "subset": "collected only"}
        strict = {"DISTRAIN_REQUIRE": "cuda"}
        code1, tail1 = self.command(
            "cuda_tests",
            [*pytest, "--requires-only", "cuda", f"--junitxml={marked_xml}", "tests/"],
            env=strict,
        )
        code2, tail2 = self.command(
            "cuda_tests:subset", [*pytest, f"--junitxml={subset_xml}", *OLD_SUBSET], env=strict
        )
        result = {"requires_cuda": _junit(marked_xml), "subset": _junit(subset_xml)}
        if code1 != 0 or code2 != 0 or result["requires_cuda"]["tests"] == 0:
            raise StageError(f"pytest exits {code1}, {code2}:\n{tail1}\n{tail2}", result)
        return result

    # -- stage 2 ------------------------------------------------------------------------------

    def throughput(self) -> dict[str, Any]:
        s = self.sizes
        result: dict[str, Any] = {}
        failed = []
        for preset in s.models:
            out = self.work / f"mfu-{preset}.json"
            out.unlink(missing_ok=True)
            argv = self.python(
                "benchmarks/mfu.py",
                "--preset", preset,
                "--seq-len", s.seq_len,
                "--micro-batch-size", s.micro_batches,
                "--ranks", 1,
                "--warmup", s.warmup,
                "--steps", s.steps,
                "--variants", s.variants,
                "--activation-checkpointing", s.checkpointing,
                "--out", out,
            )  # fmt: skip
            if s.peak_tflops is not None:
                argv += ["--peak-tflops", str(s.peak_tflops)]
            code, tail = self.command(f"throughput:{preset}", argv)
            # The JSON is rewritten after each variant: what a stopped run measured is kept.
            part = json.loads(out.read_text()) if out.exists() else {}
            part.pop("record", None)
            expected = len(s.variants.split(",")) * len(s.checkpointing.split(","))
            rows = part.get("rows", [])
            if code != 0 or len(rows) < expected or any("error" in r for r in rows):
                part["error"] = f"exit {code}, {len(rows)} of {expected} variants: {tail}"
                failed.append(preset)
            result[preset] = part
        if failed:
            raise StageError(f"failed: {', '.join(failed)}", result)
        return result

    # -- stage 3 ------------------------------------------------------------------------------

    def checkpoint(self) -> dict[str, Any]:
        s = self.sizes
        out = self.work / "checkpoint.json"
        code, tail = self.command(
            "checkpoint",
            self.python(
                "benchmarks/checkpoint.py",
                "--device", "cuda" if self.cuda else "cpu",
                "--ranks", 1,
                "--preset", s.checkpoint_preset,
                "--micro-batch-size", s.checkpoint_micro_batch,
                "--seq-len", s.seq_len,
                "--warmup", 2 if self.cuda else 1,
                "--rounds", s.checkpoint_rounds,
                "--steps", 4 if self.cuda else 2,
                "--rss-saves", 0,
                "--modes", "off,thread",
                "--out", out,
            ),
        )  # fmt: skip
        if code != 0 or not out.exists():
            raise StageError(f"exit {code}: {tail}")
        part = json.loads(out.read_text())
        part.pop("record", None)
        off, thread = (next(r for r in part["modes"] if r["mode"] == m) for m in ("off", "thread"))
        return {
            "pinned_staging": self.cuda,
            **({} if self.cuda else {"note": "CPU: staging is a host copy, not pinned memory"}),
            "sync_stall_s": off["stall_s"],
            "async_stall_s": thread["stall_s"],
            "async_stall_over_sync": thread["stall_s"] / off["stall_s"],
            "checkpoint_bytes": off["checkpoint_bytes"],
            "baseline_step_s": off["baseline_step_s"],
            "detail": part,
        }

    # -- stage 4 ------------------------------------------------------------------------------

    def planner_memory(self) -> dict[str, Any]:
        throughput = self.record["stages"].get("throughput", {}).get("result", {})
        rows, config, record = [], None, None
        for part in throughput.values():
            if not isinstance(part, dict) or "rows" not in part:
                continue
            config = config or part["config"]
            for r in part["rows"]:
                if r["compile"] or "error" in r:
                    continue  # the planner prices eager runs
                row = {
                    "preset": part["config"]["preset"],
                    "checkpointing": r["activation_checkpointing"],
                    "micro_batch_size": r["micro_batch_size"],
                }
                row.update({k: r[k] for k in ("allocated_peak", "reserved_peak") if k in r})
                rows.append(row)
            record = json.loads((self.work / f"mfu-{part['config']['preset']}.json").read_text())[
                "record"
            ]
        if not rows:
            raise StageError("no eager row of the throughput stage to compare")
        measured = self.work / "plan-measured.json"
        measured.write_text(
            json.dumps(
                {
                    "config": {
                        "seq_len": config["seq_len"],
                        "precision": "bf16",
                        "zero_stage": 0,
                        "device": config["device"],
                        "torch": torch.__version__,
                        "source": "the throughput stage's eager rows (benchmarks/mfu.py)",
                    },
                    "rows": rows,
                    "record": record,
                }
            )
        )
        out = self.work / "plan.json"
        code, tail = self.command(
            "planner_memory",
            self.python("benchmarks/plan_gpu.py", "--compare", measured, "--out", out),
        )
        if code != 0 or not out.exists():
            raise StageError(f"exit {code}: {tail}")
        part = json.loads(out.read_text())
        result = {"rows": part["rows"], "summary": part["summary"]}
        if not self.cuda:
            result["measured"] = f"{SKIPPED}: the rows are priced, with no GPU peak to compare"
        return result

    # -- stage 5 ------------------------------------------------------------------------------

    def train_argv(self, run_dir: Path, *, steps: int, profile: bool) -> list[str]:
        from distrain.models.registry import family_of_preset

        s = self.sizes
        fields = {
            "model.family": family_of_preset(s.trace_preset),
            "model.preset": s.trace_preset,
            "training.precision": "bf16",
            "training.seq_len": s.seq_len,
            "training.micro_batch_size": 1,
            "training.global_batch_size": 1,
            "training.steps": steps,
            "training.log_interval_steps": 1,
            "training.eval_interval_steps": 0,
            # Interval 0 still validates at the end: one batch, not the whole split.
            "training.eval_batches": 1,
            "checkpoint.at_end": "false",
            "checkpoint.interval_steps": 0,
            "data.max_bytes": 2_000_000,
            "metrics.progress_bar": "false",
            "metrics.tensorboard": "false",
        }
        if profile:
            fields.update({"profile.start_step": 2, "profile.num_steps": 2})
        argv = [
            sys.executable,
            "-m",
            "distrain",
            "train",
            "--nproc",
            "1",
            "--run-dir",
            str(run_dir),
        ]
        return argv + [f"--{k}={v}" for k, v in fields.items()]

    def trace(self) -> dict[str, Any]:
        run_dir = self.work / "trace-run"
        shutil.rmtree(run_dir, ignore_errors=True)
        code, tail = self.command("trace", self.train_argv(run_dir, steps=4, profile=True))
        trace_file = run_dir / "profiles" / "rank0" / "trace.json"
        if code != 0 or not trace_file.exists():
            raise StageError(f"exit {code}: {tail}")
        events = json.loads(trace_file.read_text())["traceEvents"]

        def ranges(category: str) -> list[str]:
            names = {e.get("name", "") for e in events if e.get("cat") == category}
            return sorted(n for n in names if n.startswith("distrain/"))

        host, gpu = ranges("user_annotation"), ranges("gpu_user_annotation")
        result: dict[str, Any] = {"host_ranges": host}
        missing = [p for p in PHASES if f"distrain/{p}" not in host]
        if self.cuda:
            result["gpu_ranges"] = gpu
            # The data phase runs no kernel; the others do, so they have a span on the GPU.
            missing += [f"gpu:{p}" for p in PHASES[1:] if f"distrain/{p}" not in gpu]
            result["nsys"] = self.nsys()
            if result["nsys"].get("missing"):
                missing += [f"nvtx:{p}" for p in result["nsys"]["missing"]]
        else:
            result["gpu_ranges"] = result["nsys"] = SKIPPED
        if missing:
            raise StageError(f"ranges missing from the trace: {missing}", result)
        return result

    def nsys(self) -> dict[str, Any]:
        """The NVTX ranges under Nsight Systems, where it is installed (the torch profiler's
        trace holds the record_function ranges; NVTX only a CUDA tool records)."""
        nsys = shutil.which("nsys")
        if nsys is None:
            return {"status": "not run: no nsys on PATH; NVTX itself unchecked"}
        report = self.work / "nvtx"
        run_dir = self.work / "nsys-run"
        shutil.rmtree(run_dir, ignore_errors=True)
        argv = [nsys, "profile", "--trace=cuda,nvtx", "--force-overwrite=true", "-o", str(report)]
        code, tail = self.command(
            "trace:nsys", argv + self.train_argv(run_dir, steps=3, profile=False)
        )
        if code != 0:
            return {"status": f"error: exit {code}", "tail": tail[-1000:]}
        done = subprocess.run(
            [nsys, "stats", "--report", "nvtx_sum", "--format", "csv", f"{report}.nsys-rep"],
            capture_output=True,
            text=True,
            timeout=max(min(30, self.deadline - time.monotonic()), 1),
            check=False,
        )
        names = {p for p in PHASES if f"distrain/{p}" in done.stdout}
        return {
            "status": "ok" if names == set(PHASES) else "error",
            "nvtx_ranges": sorted(f"distrain/{p}" for p in names),
            "missing": sorted(set(PHASES) - names),
        }

    def run(self) -> int:
        if self.args.dry_run:
            print("== dry run on CPU: every stage with tiny sizes, eager only", flush=True)
        elif not self.cuda:
            sys.exit("no CUDA device here; use --dry-run")
        self.stage("cuda_tests", self.cuda_tests)
        self.stage("throughput", self.throughput)
        self.stage("checkpoint", self.checkpoint)
        self.stage("planner_memory", self.planner_memory)
        self.stage("trace", self.trace)
        self.write()
        failed = self.record["failed"]
        print(
            f"== {len(self.record['stages']) - len(failed)} of {len(self.record['stages'])} "
            f"stages passed in {self.record['wall_s']} s; record: {self.out}; logs: {self.work}"
        )
        return 1 if failed else 0


def _stop_group(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _junit(path: Path) -> dict[str, Any]:
    """Counts (tests, failures, errors, skipped) and the failed tests' ids of a JUnit XML."""
    if not path.exists():
        return {"tests": 0, "failures": 0, "errors": 0, "skipped": 0, "failed": []}
    root = ET.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    counts["failed"] = [
        f"{case.get('classname')}::{case.get('name')}"
        for case in suite.iter("testcase")
        if case.find("failure") is not None or case.find("error") is not None
    ]
    return counts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="every stage on CPU, tiny sizes")
    p.add_argument("--out-dir", default="benchmarks/results", help="folder of the JSON record")
    p.add_argument("--work-dir", help="logs and intermediate JSON (default: a new temp folder)")
    p.add_argument(
        "--budget-s", type=float, default=RUN_BUDGET_S, help="the whole run's time budget"
    )
    sys.exit(Run(p.parse_args()).run())


if __name__ == "__main__":
    main()
