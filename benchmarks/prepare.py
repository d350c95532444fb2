"""Tokens per second of `distrain prepare` with 1 and 2 worker processes, against tokenizing the
same documents with the `tokenizers` library directly in one process.

Setup: a byte-level BPE (--vocab tokens, default 8192) is trained with `tokenizers` on the first
2 MB of the standard library's source; the corpus is the stdlib's `*.py` files in path order, up
to --max-bytes. Each measurement runs --repeats times and the median counts:

- tokenizers, 1 thread: read every file, `Tokenizer.encode_batch` with TOKENIZERS_PARALLELISM=false
  (the floor a one-process tool can reach; no file written);
- tokenizers, its threads: the same with the library's own thread pool (all cores);
- prepare, N processes: `distrain.data.prepare.prepare(..., workers=N)`, the whole command's
  work: listing inputs, starting the workers, tokenizing, writing DATA.bin, its document
  boundaries and sidecar (Python's start-up and imports excluded, as for the baseline).

The token counts of all rows must agree (the script stops otherwise). Each row also reports the
CPU seconds spent (this process and its finished workers): on a shared machine wall time and
tokens/s include waiting for cores that other programs hold, CPU seconds do not.

    python3 benchmarks/prepare.py                      # 8 MB, vocab 8192, 3 repeats
    python3 benchmarks/prepare.py --max-bytes 32000000 --workers 1 2 4

Prints a table and writes JSON to --out (default benchmarks/results/prepare.json).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sysconfig
import tempfile
import time
from pathlib import Path

from harness import write_json

from distrain.data.prepare import prepare

STDLIB = Path(sysconfig.get_paths()["stdlib"])
TRAIN_BYTES = 2_000_000


def corpus(max_bytes: int) -> list[Path]:
    files, total = [], 0
    for path in sorted(STDLIB.glob("**/*.py")):
        if "site-packages" in path.parts or total >= max_bytes:
            continue
        files.append(path)
        total += path.stat().st_size
    return files


def train_bpe(files: list[Path], vocab: int, out: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    sample, total = [], 0
    for f in files:
        if total >= TRAIN_BYTES:
            break
        sample.append(str(f))
        total += f.stat().st_size
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train(sample, trainer)
    tok.save(str(out))
    return out


def baseline(files: list[Path], tokenizer: Path) -> tuple[int, float]:
    """(tokens, seconds) of reading and encoding every file with `tokenizers` directly."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer))
    start = time.perf_counter()
    texts = [f.read_bytes().decode("utf-8", errors="replace") for f in files]
    encoded = tok.encode_batch(texts, add_special_tokens=False)
    seconds = time.perf_counter() - start
    return sum(len(e.ids) for e in encoded), seconds


def cpu_seconds() -> float:
    """User + system CPU time of this process and its finished children: what the work cost
    whatever else the machine runs, unlike wall time. prepare's workers are not among them (the
    forkserver forks them), so a run with workers has no CPU figure (None in the JSON)."""
    own, children = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-bytes", type=int, default=8_000_000)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/prepare.json")
    args = parser.parse_args()
    files = corpus(args.max_bytes)
    num_bytes = sum(f.stat().st_size for f in files)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="distrain-prepare-") as tmp:
        tokenizer = train_bpe(files, args.vocab, Path(tmp) / "tokenizer.json")

        def measure(name: str, run, *, counted: bool = True) -> None:  # type: ignore[no-untyped-def]
            runs, cpu = [], []
            for _ in range(args.repeats):
                before = cpu_seconds()
                runs.append(run())
                cpu.append(cpu_seconds() - before)
            tokens = {t for t, _ in runs}
            if len(tokens) != 1 or (rows and tokens != {rows[0]["tokens"]}):
                raise SystemExit(f"{name}: token counts differ: {tokens}")
            seconds = statistics.median(s for _, s in runs)
            count = tokens.pop()
            rows.append({"method": name, "tokens": count, "seconds": seconds,
                         "tokens_per_s": count / seconds,
                         "cpu_s": statistics.median(cpu) if counted else None})  # fmt: skip

        # The library's own threads first: once TOKENIZERS_PARALLELISM is false it stays off.
        measure(f"tokenizers, its threads ({os.cpu_count()} cores)",
                lambda: baseline(files, tokenizer))  # fmt: skip
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        measure("tokenizers, 1 thread", lambda: baseline(files, tokenizer))
        for workers in args.workers:

            def run_prepare(workers: int = workers) -> tuple[int, float]:
                out = Path(tmp) / f"data-{workers}.bin"
                result = prepare([str(f) for f in files], out=str(out),
                                 tokenizer=f"hf:{tokenizer}", workers=workers)  # fmt: skip
                return result.sidecar.num_tokens, result.seconds

            measure(f"distrain prepare, {workers} process(es)", run_prepare, counted=workers == 1)
    load = os.getloadavg()[0]
    print(
        f"{len(files)} files, {num_bytes / 1e6:.1f} MB, BPE vocab {args.vocab}, median of "
        f"{args.repeats}; 1-min load average {load:.1f} on {os.cpu_count()} cores"
    )
    print(f"{'method':<40}{'tokens':>12}{'seconds':>10}{'tokens/s':>12}{'CPU s':>8}")
    for r in rows:
        cpu = "-" if r["cpu_s"] is None else f"{r['cpu_s']:.2f}"
        print(
            f"{r['method']:<40}{r['tokens']:>12,}{r['seconds']:>10.2f}"
            f"{r['tokens_per_s']:>12,.0f}{cpu:>8}"
        )
    summary = {"files": len(files), "bytes": num_bytes, "vocab": args.vocab}
    summary.update(repeats=args.repeats, load_average_1min=load, rows=rows)
    write_json(args.out, summary)


if __name__ == "__main__":
    main()
