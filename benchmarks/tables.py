"""The benchmark tables of the docs, rendered from the raw JSON the scripts wrote and committed
to benchmarks/results/: no figure a JSON holds is typed by hand.

A page marks each generated block with an HTML comment naming its JSON (without `.json`):

    <!-- benchmark: moe -->
    ... (generated: the command, the table, the run's record) ...
    <!-- end benchmark -->

Its body is the command that wrote the JSON (as an indented code block, so
tests/test_doc_snippets.py checks that it parses), what RENDERERS makes of the figures, and a
line from the JSON's "record" (benchmarks/harness.py's run_record): date, load average at the
start and end, machine, torch, commit.

    python3 benchmarks/tables.py           # rewrite every marked block of docs/ from the JSON
    python3 benchmarks/tables.py --check   # write nothing; exit 1 naming each stale block

tests/test_docs.py runs the check: a table that differs from its JSON fails the tests.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DOCS = ROOT / "docs"
BLOCK = re.compile(
    r"(<!-- benchmark: (?P<name>[\w.-]+) -->\n)(?P<body>.*?)(<!-- end benchmark -->)", re.S
)
MIB = 2**20

Renderer = Callable[[dict[str, Any]], str]


def table(header: Iterable[str], rows: Iterable[Iterable[Any]]) -> str:
    header = list(header)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def span(values: list[float | None], spec: str = ".1f", scale: float = 1.0) -> str:
    """Median [min-max] of a figure over repetitions; "-" when a repetition has none."""
    if not values or any(v is None for v in values):
        return "-"
    vals = [v * scale for v in values]  # type: ignore[operator]
    med = format(statistics.median(vals), spec)
    return med if len(vals) == 1 else f"{med} [{min(vals):{spec}}-{max(vals):{spec}}]"


def record_line(name: str, record: dict[str, Any]) -> str:
    m = record["machine"]
    load_start = record["load_average_start"][0]
    load_end = record["load_average_end"][0]
    gpu = f", {m['gpu']}" if m.get("gpu") else ", no GPU"
    changes = " with uncommitted changes" if record.get("uncommitted_changes") else ""
    started = record["started"][:16].replace("T", " ")
    return (
        f"*Raw record: `benchmarks/results/{name}.json`. Run {started} to "
        f"{record['ended'][11:16]} UTC; 1-minute load average {load_start:.2f} at the start, "
        f"{load_end:.2f} at the end ({m['cores']} cores, shared); {m['cpu']}, "
        f"{m['memory_gib']} GiB{gpu}; torch {record['torch']}, commit "
        f"{record['commit']}{changes}.*"
    )


def render(name: str) -> str:
    """The generated body of block `name`, from benchmarks/results/NAME.json."""
    data = json.loads((RESULTS / f"{name}.json").read_text())
    renderer = RENDERERS[name.split("-")[0]]
    record = data["record"]
    return f"    {record['command']}\n\n{renderer(data).strip()}\n\n{record_line(name, record)}\n"


# --- one renderer per JSON ----------------------------------------------------------------------


def moe(d: dict[str, Any]) -> str:
    c = d["config"]
    dense = next(r for r in d["rows"] if r["experts"] == 0)["tokens_per_s"]
    rows = [
        (
            r["preset"],
            r["experts"],
            r["top_k"] or "-",
            f"{r['params'] / 1e6:.2f}M",
            f"{r['active_params'] / 1e6:.2f}M",
            f"{r['tokens_per_s']:,.0f}",
            f"{r['tokens_per_s'] / dense:.2f}x",
        )
        for r in d["rows"]
    ]
    head = ("preset", "experts", "top_k", "params", "active", "tokens/s", "vs dense")
    return (
        f"{c['precision']}, {c['ranks']} {c['device']} rank, seq_len {c['seq_len']}, micro-batch "
        f"{c['micro_batch_size']}, {c['warmup']} warmup + {c['steps']} timed steps:\n\n"
        + table(head, rows)
    )


def moe_ep(d: dict[str, Any]) -> str:
    rows = [
        ("all-to-all bytes rank 0 sent per step at ep2", f"{d['all_to_all_bytes_per_step']:,.0f}"),
        ("theory per exchange (balanced routing)", f"{d['theory_bytes_per_exchange']:,.0f}"),
        ("measured / theory", f"{d['measured_over_theory']:.3f}"),
        ("tokens/s at ep1", f"{d['ep1_tokens_per_s']:,.0f}"),
        ("tokens/s at ep2", f"{d['ep2_tokens_per_s']:,.0f}"),
    ]
    return (
        f"`{d['preset']}`, {d['ranks']} ranks, global batch {d['global_batch']} x "
        f"{d['seq_len']} tokens:\n\n" + table(("figure", "value"), rows)
    )


def checkpointing(d: dict[str, Any]) -> str:
    a, res = d["args"], d["results"]
    base = res["none"]
    rows = [
        (
            mode,
            f"{r['peak_added_mib']:.0f}",
            f"{r['peak_added_mib'] / base['peak_added_mib']:.2f}",
            f"{r['step_cpu_s']:.2f}",
            f"{r['step_cpu_s'] / base['step_cpu_s']:.2f}",
            f"{r['step_s']:.2f}",
        )
        for mode, r in res.items()
    ]
    head = ("mode", "step peak added (MiB)", "vs none", "step CPU s", "vs none", "step wall s")
    return (
        f"`{a['preset']}`, batch {a['batch']} x {a['seq_len']}, {a['device']}, selective every "
        f"{a['every']} blocks, median of {a['steps']} steps:\n\n" + table(head, rows)
    )


def memory(d: dict[str, Any]) -> str:
    def cell(r: dict[str, Any], part: str) -> str:
        return f"{r[part] / MIB:.2f} / {r[part + '_theory'] / MIB:.2f}"

    rows = [
        (
            r["world_size"],
            r["zero_stage"],
            cell(r, "params"),
            cell(r, "grads"),
            cell(r, "optimizer"),
        )
        for r in d["rows"]
        if r["world_size"] > 1 or r["zero_stage"] == 0
    ]
    head = ("N", "stage", "params MiB", "grads MiB", "optimizer MiB")
    c = d["config"]
    return (
        f"`{c['preset']}` (Ψ = {c['psi'] / 1e6:.1f}M), {c['dtype']}, {c['backend']}, measured / "
        f"theory, the largest rank's (at N = 1 every stage is the same; stage 0 shown):\n\n"
        + table(head, rows)
    )


def overhead(d: dict[str, Any]) -> str:
    c = d["config"]
    rows = [
        (
            r["accum"],
            f"{r['distrain_step_s'] * 1e3:.1f}",
            f"{r['handwritten_step_s'] * 1e3:.1f}",
            f"**{r['ratio']:.3f}**",
            f"{r['max_loss_diff']:.1e}",
        )
        for r in d["by_accum"]
    ]
    head = ("micro-batches per step", "distrain ms/step", "hand-written DDP ms/step", "ratio",
            "largest loss difference")  # fmt: skip
    return (
        f"`{c['preset']}`, {c['num_ranks']} ranks, {c['backend']}, micro-batch "
        f"{c['micro_batch_size']} x {c['seq_len']}, {c['blocks']} interleaved blocks of "
        f"{c['steps_per_block']} steps per side after {c['warmup']} warmup steps, "
        f"OMP_NUM_THREADS={c['omp_num_threads']}; median block:\n\n" + table(head, rows)
    )


def mfu(d: dict[str, Any]) -> str:
    c = d["config"]
    rows = [
        (
            "yes" if r["compile"] else "no",
            f"{r['step_s'] * 1e3:.1f}",
            f"{r['tokens_per_s']:,.0f}",
            f"{r['achieved_flops_per_device'] / 1e9:.1f}",
            f"{r['mfu']:.1%}",
        )
        for r in d["rows"]
    ]
    head = ("compile", "ms/step", "tokens/s", "GFLOP/s", "MFU")
    return (
        f"`{c['preset']}`, {c['precision']}, {c['ranks']} {c['device']} process, seq_len "
        f"{c['seq_len']}, micro-batch {c['micro_batch_size']}, {c['warmup']} warmup + "
        f"{c['steps']} timed steps; peak {c['peak_flops_per_device'] / 1e9:.1f} GFLOP/s "
        f"({c['peak_source']}):\n\n" + table(head, rows)
    )


RENDERERS: dict[str, Renderer] = {
    "mfu": mfu,
    "overhead": overhead,
    "moe": moe,
    "moe_ep": moe_ep,
    "checkpointing": checkpointing,
    "memory": memory,
}


# --- pages --------------------------------------------------------------------------------------


def blocks(text: str) -> list[re.Match[str]]:
    return list(BLOCK.finditer(text))


def refresh(text: str) -> str:
    return BLOCK.sub(lambda m: m.group(1) + render(m.group("name")) + m.group(4), text)


def pages() -> list[Path]:
    return sorted(DOCS.rglob("*.md"))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if stale")
    args = parser.parse_args(argv)
    stale = []
    for page in pages():
        text = page.read_text()
        new = refresh(text)
        if new == text:
            continue
        stale += [
            f"{page.relative_to(ROOT)}: {m.group('name')}"
            for m, n in zip(blocks(text), blocks(new), strict=True)
            if m.group("body") != n.group("body")
        ]
        if not args.check:
            page.write_text(new)
    verb = "stale" if args.check else "rewrote"
    for entry in stale:
        print(f"{verb}: {entry}")
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
