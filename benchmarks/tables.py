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
GIB = 2**30
SERVERS = {"seaweedfs": "SeaweedFS"}  # a record's S3 server, as the docs name it

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


def vs_accelerate(d: dict[str, Any]) -> str:
    c = d["config"]
    rows = [
        (
            r["variant"],
            span(r["tokens_per_s_reps"], ",.0f"),
            f"{r['setup_s']:.2f}",
            f"{r['time_to_target_s']:.2f}",
            f"{r['final_loss']:.4f}",
            f"{r['ratio_tokens_per_s']:.2f}",
            f"{r['ratio_time_to_target']:.2f}",
            f"{r['projected_job_s']:.0f}",
            f"{r['ratio_projected_job']:.2f}",
        )
        for r in d["rows"]
    ]
    head = ("variant", "tokens/s [min-max]", "setup s", "to target s", "final loss",
            "ratio tok/s", "ratio time", f"{c['job_steps']}-step job s", "ratio job")  # fmt: skip
    return (
        f"`{c['preset']}`, global batch {c['global_batch_size']} x seq {c['seq_len']}, "
        f"micro-batch {c['micro_batch_size']}, {c['warmup']} warmup + {c['steps']} timed steps, "
        f"{c['reps']} interleaved repetitions (medians); target loss {c['target_loss']:.4f}; "
        f"ratios against accelerate fp32 2x1:\n\n" + table(head, rows)
    )


def slow_link(d: dict[str, Any]) -> str:
    c = d["config"]

    def ratio(x: float | None) -> str:
        return f"{x:.2f}" if x else "-"

    def predicted(r: dict[str, Any], key: str = "step_s") -> float | None:
        """The planner's step: on the shaped rate ("step_s") or on the probed one."""
        return (r.get("planner_prediction") or {}).get(key)

    def error(r: dict[str, Any], key: str = "step_s") -> float:
        return predicted(r, key) / statistics.median(r["step_s"]) - 1

    def planned(r: dict[str, Any], key: str = "step_s") -> str:
        return f"{predicted(r, key):.2f} ({error(r, key):+.0%})" if predicted(r, key) else "-"

    probed = "step_s_measured_link"
    probing = any(r.get("link_probe") for r in d["rows"])
    rows = []
    for r in d["rows"]:
        name = f"**{r['variant']} (recipe)**" if r["recipe"] else r["variant"]
        reached = span(r["time_to_loss_s"])
        rows.append(
            (
                r["link"],
                r["preset"],
                name,
                reached if reached != "-" else "not reached",
                ratio(r["time_to_loss_x_peer"]),
                ratio(r.get("time_to_loss_x_best_accelerate")),
                span(r["tokens_per_s"], ".0f"),
                span(r["step_s"], ".2f"),
                span(r["wire_bytes_per_step"], ".2f", 1e-6),
                span(r["counted_bytes_per_step"], ".2f", 1e-6),
                span(r["final_val_loss"], ".4f"),
                planned(r),
                *((planned(r, probed),) if probing else ()),
            )
        )
    head = ("link", "preset", "variant", "to loss s", "x accelerate ddp", "x best accelerate",
            "tokens/s", "s/step", "wire MB/step", "counted MB/step", "val loss",
            "planned s/step", *(("on the probed link",) if probing else ()))  # fmt: skip
    links = {r["link"] for r in d["rows"]}
    where = (
        f"{2 * c['procs']} processes on one machine's loopback"
        if links == {"loopback"}
        else f"2 hosts x {c['procs']} process"
    )
    errors = [abs(error(r)) for r in d["rows"] if predicted(r)]
    own = any(predicted(r, "compute_s") for r in d["rows"])
    concurrency = next((predicted(r, "concurrency") for r in d["rows"] if own and predicted(r)), 0)
    basis = (
        "each variant's compute from its own step on loopback (the compute at which the model "
        "gives that step on loopback's probed rate and concurrency), plus the communication "
        "distrain.plan.comm_advice predicts on the link's shaped rate with this machine's "
        f"concurrency as `distrain plan --calibrate` measures it, {concurrency:.2f} on loopback"
        if own
        else "distrain ddp's step on loopback as the compute, plus the communication "
        "distrain.plan.comm_advice predicts on the link"
    )
    planner = (
        f" The planner's step (planned s/step: {basis}) is within 20% "
        f"of the measured median on {sum(e <= 0.2 for e in errors)} of {len(errors)} rows "
        f"(largest |error| {max(errors):.0%})."
        if errors
        else ""
    )
    probed_errors = [abs(error(r, probed)) for r in d["rows"] if predicted(r, probed)]
    if probed_errors:
        probes = {r["link"]: r["link_probe"] for r in d["rows"] if predicted(r, probed)}
        measured = ", ".join(
            f"{link}: {p['sent_bytes_per_s'] * 8e-6:.0f} Mbit/s "
            f"({p['sent_bytes_per_s'] * 8 / p['shaped_bits_per_s']:.0%})"
            + (f", concurrency {p['concurrency']:.2f}" if own else "")
            for link, p in sorted(probes.items())
        )
        what = (
            "the rate and concurrency the link probe measured on the link before the runs (an "
            f"all-reduce of the gradients' bytes: {measured})"
            if own
            else "the rate an all-reduce of the gradients' bytes reached over the link before "
            f"the runs (the link probe: {measured} of the shaped rate)"
        )
        planner += (
            f" On {what}, the same prediction (on the probed link) is within 20% on "
            f"{sum(e <= 0.2 for e in probed_errors)} of {len(probed_errors)} rows (largest "
            f"|error| {max(probed_errors):.0%})."
        )
    return (
        f"{where} (gloo, CPU, OMP_NUM_THREADS=1), global batch "
        f"{c['global_batch_size']} x seq {c['seq_len']}, micro-batch {c['micro_batch_size']}, "
        f"{c['steps']} steps, validation every {c['eval_every']}, {c['reps']} interleaved "
        f"repetitions: median [min-max]; target: accelerate ddp's final validation loss on the "
        f"link.{planner}\n\n" + table(head, rows)
    )


def checkpoint(d: dict[str, Any]) -> str:
    c = d["config"]
    # Older records have no write time; a run with --rss-saves 0 no memory check.
    write = "write_s" in d["modes"][0]
    rss = next(iter(d["rss_mib_after_each_save"].values()))

    def ms(seconds: float) -> str:
        return "-" if seconds != seconds else f"{seconds * 1e3:.0f}"  # NaN: none in flight

    rows = [
        (
            r["mode"],
            ms(r["stall_s"]),
            *([ms(r["write_s"])] if write else []),
            ms(r["lost_s"]),
            ms(r["baseline_step_s"]),
            ms(r["in_flight_step_s"]),
            f"{r['goodput']:.3f}",
            *(
                []
                if not rss
                else ["-"]
                if r["mode"] not in d["ratios"]
                else [f"{d['ratios'][r['mode']]['rss_slope_mib_per_save']:+.2f}"]
            ),
        )
        for r in d["modes"]
    ]
    head = (
        "mode",
        "stall ms",
        *(["write ms"] if write else []),
        "lost ms",
        "step ms",
        "in-flight step ms",
        "goodput",
        *(["memory MiB/save"] if rss else []),
    )
    ratios = "; ".join(
        f"{mode}: stall / off {r['stall_over_off']:.2f}, in-flight step / step "
        f"{r['in_flight_step_over_step']:.2f}"
        for mode, r in d["ratios"].items()
    )
    where = ""
    if c.get("storage") == "s3":
        where = (
            f", saves to S3 ({SERVERS[c['server']]}) behind a link shaped to "
            f"{c['link_mbit']:g} Mbit/s "
            f"({c['link_sent_bytes'] / 1e6:.0f} MB sent on it during the rounds: "
            f"{len(d['modes']) * c['rounds']} saves of "
            f"{d['modes'][0]['checkpoint_bytes'] / 1e6:.0f} MB)"
        )
    memory = f"; memory: slope over {len(rss)} saves from the 10th on" if rss else ""
    return (
        f"`{c['preset']}`, {c['num_ranks']} ranks ({c['backend']}, {c['device']}), micro-batch "
        f"{c['micro_batch_size']} x {c['seq_len']}{where}, {c['rounds']} rounds of a save and "
        f"{c['steps_per_block']} steps per mode, median over rounds, slowest rank{memory}:\n\n"
        + table(head, rows)
        + f"\n\n{ratios}."
    )


def label(key: str) -> str:
    """A JSON key as a table's words: `signal_to_exit_s` -> "signal to exit s"."""
    return key.replace("_", " ").replace(" mb", " MiB")


def _runs_table(runs: list[dict[str, float]], median: dict[str, float], unit: str) -> str:
    """A figure per row: its median, then each run's."""
    head = ("figure", f"median {unit}".strip(), *(f"run {i + 1}" for i in range(len(runs))))
    rows = [
        (label(key), f"**{value:.2f}**", *(f"{run[key]:.2f}" for run in runs))
        for key, value in median.items()
    ]
    return table(head, rows)


def recovery(d: dict[str, Any]) -> str:
    c, inproc = d["config"], d["inprocess"]
    parts = [
        f"`{c['preset']}`, {c['ranks']} ranks ({c['backend']}, ZeRO-3, one thread each); the "
        f"restart path is killed at step {c['kill_step']}, after the checkpoint of step "
        f"{c['checkpoint_step']}."
    ]
    if d["runs_s"]:
        parts.append(
            f"Restart path ({c['launch']}), seconds:\n\n"
            + _runs_table(d["runs_s"], d["median_s"], "s")
        )
    plain = inproc.get("plain_median", {}).get("steady step")
    if plain is not None:
        parts.append(
            f"Plain run (the same 2 ranks, no replica groups, no fault): steady step "
            f"**{plain:.3f} s** (median of steps 3 to {inproc['kill_step'] - 2})."
        )
    for name, runs in inproc["runs"].items():
        median = inproc["median"][name]
        hb = inproc["settings"][name]["heartbeat_timeout_ms"]
        overhead = (
            f"; steady step {median['steady step'] / plain:.2f}x the plain run's"
            if plain is not None
            else ""
        )
        parts.append(
            f"In-process path ({inproc['launch']}; `distrain lighthouse "
            f"--heartbeat-timeout-ms {hb}`; group 1 killed before step {inproc['kill_step']}, "
            f"{inproc['steps_after_kill']} steps after; changes = membership rows of group 0, "
            f"the kill's and the rejoin's{overhead}), seconds:\n\n" + _runs_table(runs, median, "")
        )
    return "\n\n".join(parts)


def replica_churn(d: dict[str, Any]) -> str:
    c = d["config"]
    head = ("lighthouse join timeout", "heartbeat timeout", "membership changes", "kinds", "step s")
    rows = [
        (
            f"{r['join_timeout_s']:g} s",
            f"{r['heartbeat_timeout_ms']} ms",
            f"**{r['changes']}**",
            ", ".join(f"{k} {v}" for k, v in sorted(r["by_kind"].items())) or "-",
            f"{r['steady_step_s']:.3f}",
        )
        for r in d["runs"]
    ]
    return (
        f"{c['groups']} groups of {c['ranks_per_group']} rank (`{c['preset']}`, ZeRO-3, "
        f"{c['threads_per_group']} thread each), {c['steps']} steps, no fault, "
        f"{c['busy_processes']} busy processes beside them on {c['cpus']} cores; every "
        "membership row of every group counted:\n\n" + table(head, rows)
    )


def preempt(d: dict[str, Any]) -> str:
    c = d["config"]
    parts = [
        f"{c['signal']} after step {c['signal_after_step']} of `{c['launch']}` ({c['backend']}, "
        f"global batch {c['global_batch_size']} x {c['seq_len']})."
    ]
    for preset, result in d["presets"].items():
        parts.append(f"`{preset}`:\n\n" + _runs_table(result["runs"], result["median"], ""))
    return "\n\n".join(parts)


def prepare(d: dict[str, Any]) -> str:
    rows = [
        (
            r["method"],
            f"{r['seconds']:.2f}",
            f"{r['tokens_per_s']:,.0f}",
            "-" if r["cpu_s"] is None else f"{r['cpu_s']:.2f}",
        )
        for r in d["rows"]
    ]
    return (
        f"{d['files']} files, {d['bytes'] / 1e6:.1f} MB, {d['rows'][0]['tokens']:,} tokens of "
        f"a {d['vocab']}-token BPE, median of {d['repeats']}:\n\n"
        + table(("method", "seconds", "tokens/s", "CPU seconds"), rows)
    )


def pipeline(d: dict[str, Any]) -> str:
    c, m = d["config"], d["config"]["model"]
    rows = []
    for r in d["results"]:
        theory = f"{r['theory']:.1%}"
        if "theory_upper_bound" in r:
            theory += f" (estimate; {r['theory_upper_bound']:.1%} bound)"
        idle = [f"{rank['idle']:.1%}" for rank in r["ranks"]]
        rows.append((r["schedule"], *idle, theory, f"{r['mean_step_s'] * 1e3:.0f}"))
    head = ("schedule", *(f"rank {i} idle" for i in range(c["pp"])), "theory", "step ms")
    return (
        f"p = {c['pp']}, m = {c['microbatches']}, v = {c['stages_per_rank_interleaved']}, "
        f"micro-batch {c['micro_batch_size']} x {c['seq_len']}, GPT dim {m['dim']} x "
        f"{m['n_layers']} layers, {c['backend']}, {c['threads_per_rank']} thread per rank, "
        f"{c['steps']} timed steps after {c['warmup']} warmup:\n\n" + table(head, rows)
    )


def context(d: dict[str, Any]) -> str:
    rows = [
        (
            r["cp"],
            r["method"] if r["cp"] > 1 else "-",
            r["seq_len"],
            r["seq_len"] // r["cp"],
            f"{r['activations_mib']:.1f}",
            f"{r['peak_rss_mib']:.0f}",
        )
        for r in d["rows"]
    ]
    head = ("cp", "method", "seq_len", "tokens per rank", "activations MiB", "peak RSS MiB")
    fits = ", ".join(f"{name} {seq or 'none'}" for name, seq in d["fits"].items())
    return (
        "`tiny`, micro-batch 1, CPU/gloo; per rank, the largest over ranks:\n\n"
        + table(head, rows)
        + f"\n\nLongest measured sequence within {d['budget_mib']:.0f} MiB of peak RSS per "
        f"rank: {fits}."
    )


def faults(d: dict[str, Any]) -> str:
    def mark(value: bool | None) -> str:
        return "-" if value is None else ("yes" if value else "**no**")

    rows, skipped = [], []
    for r in d["runs"]:
        if "skipped" in r:
            skipped.append(f"{r['fault']} (not run: {r['skipped']})")
            continue
        seconds = "-" if r["recovery_s"] is None else f"{r['recovery_s']:.1f}"
        rows.append(
            (r["fault"], r["seed"], r["rank"], r["step"], mark(r["finished"]),
             mark(r["losses_match"]), r["steps_lost"], seconds, mark(r["diagnosis_rank"]),
             mark(r["diagnosis_cause"]))
        )  # fmt: skip
    head = ("fault", "seed", "rank", "step", "finished", "losses = uninterrupted", "steps lost",
            "recovery s", "diagnose: rank", "diagnose: cause")  # fmt: skip
    summary = [
        (fault, s["runs"], s["finished"], s["losses_match"], s["steps_lost_max"],
         "-" if s["recovery_s_median"] is None else f"{s['recovery_s_median']:.1f}",
         s["diagnosis_rank"], s["diagnosis_cause"])
        for fault, s in d["summary"].items()
    ]  # fmt: skip
    sum_head = ("fault", "runs", "finished", "losses = uninterrupted", "most steps lost",
                "median recovery s", "diagnose: rank", "diagnose: cause")  # fmt: skip
    text = f"`{d['config']['launch']}`:\n\n" + table(head, rows)
    text += "\n\nBy fault:\n\n" + table(sum_head, summary)
    if skipped:
        text += "\n\nNot run: " + "; ".join(skipped) + "."
    return text


def data(d: dict[str, Any]) -> str:
    a = d["args"]

    def ms(seconds: float) -> str:
        return f"{seconds:.2f} s" if seconds >= 1 else f"{seconds * 1e3:.2f} ms"

    where = {"local": "local", "s3": "S3, shaped"}
    waits = [
        (where[w], mode.split()[-1], ms(s["first_s"]), ms(s["median_s"]), ms(s["p99_s"]),
         ms(s["max_s"]))
        for w in ("local", "s3")
        for mode, s in d[w].items()
    ]  # fmt: skip
    rss = [
        (size, f"{r['loader_peak_rss_mb']:.1f} MB", f"{r['read_mb']:.0f} MB")
        for size, r in d["rss"].items()
    ]
    return (
        f"Data wait per step: global batch {a['batch']} x {a['seq_len']} tokens, shards of "
        f"{a['shard_mb']} MB, each step followed by {a['step_ms']:g} ms of simulated compute; "
        f"local: {a['rounds']} x {a['steps']} steps per mode on a {a['local_gb']:g} GB dataset; "
        f"S3: {a['steps']} steps per mode from a {a['s3_mb']} MB dataset on the local SeaweedFS "
        f"server through a relay shaping the link to {a['rate_mbit']:g} Mbit/s with "
        f"{a['delay_ms']:g} ms before each request:\n\n"
        + table(("where", "data.prefetch_batches", "first step", "median", "p99", "max"), waits)
        + f"\n\nPeak memory of the loader (largest resident set after any of {a['rss_steps']} "
        "steps, minus the process's before the loader was built; prefetch 2):\n\n"
        + table(("dataset", "loader peak RSS", "samples read"), rss)
    )


def comm(d: dict[str, Any]) -> str:
    c, res = d["config"], d["results"]
    links = c["links"]
    base = res.get("none")

    def step(method: str, link: str) -> str:
        ms = res[method][link]["step_time_s"] * 1e3
        return f"{ms:.0f} ({ms / (base[link]['step_time_s'] * 1e3):.2f})" if base else f"{ms:.0f}"

    rows = []
    for method, by_link in res.items():
        first = by_link[links[0]]
        progress = first.get("progress")
        rows.append(
            (
                method,
                f"{first['comm_bytes'] / 1e6:.3f}",
                f"{first['comm_compression_ratio']:.1f}",
                *(step(method, link) for link in links),
                f"{first['final_loss']:.4f}",
                "-" if progress is None else f"{progress:.3f}",
            )
        )
    step_head = [f"{link} ms" + (" (x none)" if base else "") for link in links]
    head = ("method", "MB sent per step", "x fewer than fp32", *step_head, "final loss",
            "progress vs none")  # fmt: skip
    text = (
        f"`{c['preset']}`, {c['num_ranks']} ranks x 1 process ({c['backend']}, CPU, "
        f"OMP_NUM_THREADS=1), micro-batch {c['micro_batch_size']} x {c['seq_len']}, "
        f"{c['steps']} steps, 1-bit Adam's freeze step and PowerSGD's start "
        f"{c['freeze_step']}; bytes and step time: medians over the steps after "
        f"{max(c['skip_steps'], c['freeze_step'])}; loss and progress on {links[0]}:\n\n"
        + table(head, rows)
    )
    if d.get("hidden_fraction"):
        text += (
            f"\n\nOverlap (`none` against two side-by-side 1-rank runs, "
            f"{d['solo_step_s'] * 1e3:.0f} ms/step): "
            + ", ".join(f"{link} {frac:.0%}" for link, frac in d["hidden_fraction"].items())
            + " of its communication hidden (an upper estimate on the shaped links)."
        )
    return text


def export(d: dict[str, Any]) -> str:
    rows = [
        (
            r["dtype"],
            f"{r['seconds']:.1f}",
            f"{r['peak_rss_mb']:.0f}",
            f"{r['after_imports_mb']:.0f}",
            f"{r['peak_rss_mb'] - r['after_imports_mb']:.0f}",
        )
        for r in d["rows"]
    ]
    head = ("to dtype", "seconds", "peak RSS MiB", "after imports MiB", "peak - imports MiB")
    return (
        f"`distrain export --format hf` of a 1-step `{d['preset']}` checkpoint, each export in a "
        f"fresh process; {d['weights_fp32_mb']:.0f} MiB of fp32 weights:\n\n" + table(head, rows)
    )


def plan_gpu(d: dict[str, Any]) -> str:
    c, s = d["config"], d["summary"]

    def peak(r: dict[str, Any], key: str) -> str:
        return f"{r[key] / GIB:.2f}" if key in r else "-"

    def error(r: dict[str, Any], key: str) -> str:
        return f"{r[key]:+.1%}" if key in r else "out of memory"

    rows = [
        (
            r["preset"],
            r["checkpointing"],
            r["micro_batch_size"],
            peak(r, "allocated_peak"),
            peak(r, "reserved_peak"),
            peak(r, "modelled_peak"),
            error(r, "modelled_error"),
            peak(r, "built_peak"),
            error(r, "built_error"),
        )
        for r in d["rows"]
    ]
    head = (
        "preset",
        "ac",
        "mb",
        "GPU allocated GiB",
        "GPU reserved GiB",
        "modelled GiB",
        "error",
        "fake build GiB",
        "error",
    )
    measured = d["measured_record"]
    return (
        f"One {c['device']} (torch {c['torch']}), {c['precision']}, ZeRO-{c['zero_stage']}, seq "
        f"{c['seq_len']}, {c['steps']} steps, one micro-batch a step: the peak of "
        "`torch.cuda.max_memory_allocated` against the memory model and the full fake build. "
        f"|error| of the model: median {s['median_abs_error']:.1%}, largest "
        f"{s['max_abs_error']:.1%}; {s['within_5_percent']} of {s['rows']} rows within 5%. The "
        f"GPU half ran {measured['started'][:16].replace('T', ' ')} UTC, commit "
        f"{measured['commit']}"
        + (" with uncommitted changes" if measured.get("uncommitted_changes") else "")
        + ".\n\n"
        + table(head, rows)
    )


def plan_error(d: dict[str, Any]) -> str:
    c, s = d["config"], d["summary"]

    def layout(r: dict[str, Any]) -> str:
        x = r["layout"]
        sites = f"DiLoCo {x['dp_replicate']} sites x " if r.get("diloco") else ""
        split = "".join(f" {k} {x[k]}" for k in ("cp", "ep") if x.get(k, 1) > 1)
        return (
            f"{sites}dp {x['dp_shard']} tp {x['tp']} pp {x['pp']}{split}, "
            f"ZeRO-{x['zero_stage']}, ac {x['activation_checkpointing']}, "
            f"mb {x['micro_batch_size']}"
        )

    def mib(r: dict[str, Any], key: str) -> str:
        return f"{r[key]['peak'] / MIB:.2f}" if key in r else "-"

    def error(r: dict[str, Any]) -> str:
        return f"{r['peak_error']:+.1%}" if "peak_error" in r else f"not priced: {r['error']}"

    rows = [
        (r["preset"], layout(r), mib(r, "modelled"), mib(r, "built"), error(r)) for r in d["memory"]
    ]
    head = ("preset", "layout", "modelled peak MiB", "built peak MiB", "error")
    text = (
        f"Peak per rank on {c['world_size']} ranks, {c['n_layers']} blocks, seq {c['seq_len']}, "
        f"global batch {c['global_batch']}: the memory model against the full fake build. "
        f"{s['priced']} of {s['rows']} sampled layouts priced, {s['within_goal']} of them within "
        f"{d['goal']:.0%}; |error| median {s['median_abs_error']:.1%}, largest "
        f"{s['max_abs_error']:.1%}.\n\n" + table(head, rows)
    )
    if "plan_time" not in d:
        return text
    times = [
        (
            f"`{r['command']}`",
            f"{r['cold']['wall_s']:.1f}",
            f"{r['cold']['cpu_s']:.1f}",
            f"{r['warm']['wall_s']:.1f}",
            f"{r['warm']['cpu_s']:.1f}",
            f"{r['cold']['load_before']:.1f} / {r['warm']['load_after']:.1f}",
            "yes" if r["same_answer"] else "no",
        )
        for r in d["plan_time"]
    ]
    head = (
        "command",
        "cold wall s",
        "cold CPU s",
        "warm wall s",
        "warm CPU s",
        "load",
        "same JSON",
    )
    return (
        text
        + "\n\nTime of the plan, cold (a fresh cache directory) then warm (asked again), CPU of "
        "the command and every process it starts, load average before the cold run and after "
        "the warm one:\n\n" + table(head, times)
    )


def finetune(d: dict[str, Any]) -> str:
    c, imp = d["config"], d["import"]
    figures = (
        ("tokens/s", "tokens_per_s", ",.0f"),
        ("peak RSS MiB", "peak_rss_mib", ".0f"),
        ("time to first step s", "first_step_s", ".1f"),
    )
    rows = [
        (
            r["nproc"],
            name,
            span(r[f"full_{key}"], spec),
            span(r[f"lora_{key}"], spec),
            f"{r[f'ratio_{key}']:.2f}",
        )
        for r in d["rows"]
        for name, key, spec in figures
    ]
    head = ("processes", "figure", "full", "LoRA", "LoRA / full")
    return (
        f"A transformers-made Llama of {c['params'] / 1e6:.1f}M parameters (LoRA trains "
        f"{c['lora_trainable'] / 1e6:.2f}M: `{c['lora']}`), `distrain train` from its folder, "
        f"batch {c['global_batch']} x {c['seq_len']} tokens, {c['steps']} steps ({c['warmup']} "
        f"left out of tokens/s), {c['device']}, median [min-max] of {c['repeats']} runs:\n\n"
        + table(head, rows)
        + f"\n\nImport of the folder (in one process, median of 3): "
        f"{span(imp['import_s'], '.2f')} s; the seeded init of the same model "
        f"{span(imp['seeded_init_s'], '.2f')} s."
    )


def plan_speed_presets(d: dict[str, Any]) -> str:
    def params(n: int) -> str:
        return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"

    def row(r: dict[str, Any]) -> tuple[Any, ...]:
        head = (f"`{r['preset']}`", r["family"], params(r["params"]), r["question"])
        if "error" in r:
            return (*head, f"failed: {r['error'][0]}", "-", "-", "-", "-", "-", "-")
        c, w = r["cold"], r["warm"]
        return (
            *head,
            f"{c['wall_s']:.1f}",
            f"{c['cpu_s']:.1f}",
            f"{w['wall_s']:.1f}",
            f"{w['cpu_s']:.1f}",
            r["stored_builds"],
            f"{c['load_before']:.1f} / {w['load_after']:.1f}",
            "yes" if r["same_answer"] else "no",
        )

    timed = [r for r in d["rows"] if "error" not in r]
    cold = max(timed, key=lambda r: r["cold"]["wall_s"])
    warm = max(timed, key=lambda r: r["warm"]["wall_s"])
    cpu = max(timed, key=lambda r: r["cold"]["cpu_s"])
    loads = [r[k]["load_before"] for r in timed for k in ("cold", "warm")]
    loads += [r[k]["load_after"] for r in timed for k in ("cold", "warm")]
    head = (
        "preset",
        "family",
        "params",
        "question",
        "cold wall s",
        "cold CPU s",
        "warm wall s",
        "warm CPU s",
        "store files",
        "load",
        "same JSON",
    )
    return (
        "`distrain plan --preset P --nodes 8 --gpus-per-node 8 --gpu-memory 80GB --json`, "
        "question `default` at the default batch, `1024x4096` adding `--seq-len 4096 "
        "--global-batch 1024` (the 7B-class presets), each cold (a fresh `XDG_CACHE_HOME`) then "
        "warm (the same cache, a second process); CPU of the command and every process it "
        "starts; files the cold plan kept in its build store (fake builds and parameter tables); "
        "load average before the cold run and after the "
        f"warm one. {len(d['rows'])} plans, {len(d['rows']) - len(timed)} failed; slowest cold "
        f"{cold['cold']['wall_s']:.1f} s (`{cold['preset']}`, {cold['question']}), most CPU cold "
        f"{cpu['cold']['cpu_s']:.1f} s (`{cpu['preset']}`, {cpu['question']}), slowest warm "
        f"{warm['warm']['wall_s']:.1f} s (`{warm['preset']}`, {warm['question']}); 1-minute "
        f"load average {min(loads):.1f} to {max(loads):.1f} around the runs:\n\n"
        + table(head, [row(r) for r in d["rows"]])
    )


RENDERERS: dict[str, Renderer] = {
    "finetune": finetune,
    "plan_error": plan_error,
    "plan_speed_presets": plan_speed_presets,
    "data": data,
    "faults": faults,
    "context": context,
    "prepare": prepare,
    "pipeline": pipeline,
    "preempt": preempt,
    "recovery": recovery,
    "replica_churn": replica_churn,
    "checkpoint": checkpoint,
    "slow_link": slow_link,
    "vs_accelerate": vs_accelerate,
    "mfu": mfu,
    "overhead": overhead,
    "moe": moe,
    "moe_ep": moe_ep,
    "checkpointing": checkpointing,
    "memory": memory,
    "comm": comm,
    "export": export,
    "plan_gpu": plan_gpu,
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
