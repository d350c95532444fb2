"""Activation checkpointing modes compared: peak memory of a training step and its time.

For each `training.activation_checkpointing` mode (none, full, selective = every
`--every`-th block, selective_op = per-op) a fresh process builds the model with distrain's own
`apply_activation_checkpointing`, then:

- memory: the peak of the bytes allocated during one forward + backward, above what was
  allocated before it (model, gradients and optimizer state exist already, so this is what the
  step adds: activations kept for backward, recomputation and backward buffers). On CPU, where
  torch keeps no allocator statistics, it is summed from the profiler's allocation and free
  events (`profile_memory=True`), in order; on CUDA it is `torch.cuda.max_memory_allocated`.
  (The process's peak resident set was tried first and is useless here: glibc keeps and
  fragments freed memory.)
- time: the median of `--steps` further forward + backward + AdamW steps, as wall-clock seconds
  and as CPU seconds of the process (`time.process_time`, all its threads): on a shared machine
  the CPU seconds are the figure that other processes disturb least.

Run from the repository root; prints a markdown table and writes JSON to --out:

    python3 benchmarks/checkpointing.py
    python3 benchmarks/checkpointing.py --preset small --seq-len 1024 --batch 8
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch
from harness import write_json

from distrain.config.schema import ModelConfig
from distrain.models.decoder.model import Decoder, init_weights
from distrain.models.registry import model_args
from distrain.parallel.activation_checkpointing import apply_activation_checkpointing

MODES = ("none", "full", "selective", "selective_op")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="small", help="model preset")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--every", type=int, default=2, help="selective: every k-th block")
    parser.add_argument("--steps", type=int, default=3, help="timed steps after the measured one")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default="benchmarks/results/checkpointing.json")
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)  # one child's mode
    return parser.parse_args(argv)


def run_mode(args: argparse.Namespace) -> dict[str, float]:
    """One mode in this process: the step's added peak (MiB) and the median step time (s)."""
    device = torch.device(args.device)
    margs = model_args(ModelConfig(preset=args.preset))
    model = Decoder(margs).to(device)
    init_weights(model, margs, seed=0)
    apply_activation_checkpointing(model.blocks, args.mode, every=args.every)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, margs.vocab_size, (args.batch, args.seq_len + 1), generator=gen)
    inputs, targets = tokens[:, :-1].to(device), tokens[:, 1:].to(device)
    for p in model.parameters():  # gradients exist before the measured step in every mode
        p.grad = torch.zeros_like(p)
    optimizer.step()  # and so does the optimizer state

    def step() -> None:
        logits = model(inputs)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward()

    if device.type == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        added = torch.cuda.max_memory_allocated() - before
    else:
        with torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
        ) as prof:
            step()
        events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
        added = current = 0
        for event in sorted(events, key=lambda e: e.start_ns()):
            current += event.nbytes()  # negative for a free
            added = max(added, current)
    times, cpu_times = [], []
    for _ in range(args.steps):
        start, cpu_start = time.perf_counter(), time.process_time()
        step()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu_start)
    return {
        "peak_added_mib": added / 2**20,
        "step_s": statistics.median(times),
        "step_cpu_s": statistics.median(cpu_times),
    }


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    if args.mode is not None:
        print(json.dumps(run_mode(args)))
        return
    results = {}
    for mode in MODES:
        out = subprocess.run(
            [sys.executable, __file__, *argv, "--mode", mode],
            capture_output=True,
            text=True,
            check=True,
        )
        results[mode] = json.loads(out.stdout.splitlines()[-1])
    base = results["none"]
    print(f"preset {args.preset}, batch {args.batch} x seq {args.seq_len}, {args.device}")
    print("| mode | step peak added (MiB) | vs none | step CPU s | vs none | step wall s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for mode, r in results.items():
        print(
            f"| {mode} | {r['peak_added_mib']:.0f} | "
            f"{r['peak_added_mib'] / base['peak_added_mib']:.2f} | {r['step_cpu_s']:.2f} | "
            f"{r['step_cpu_s'] / base['step_cpu_s']:.2f} | {r['step_s']:.2f} |"
        )
    write_json(args.out, {"args": vars(args), "results": results})


if __name__ == "__main__":
    main(sys.argv[1:])
