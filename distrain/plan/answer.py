"""The text answer of `distrain plan`, within WIDTH columns: the question as the plan read it,
the recommendation (layout, data-parallel communication, micro-batch: one reason and the config
lines each), the communication methods predicted for the recommended layout, and the ranked
layouts in a compact table. Every figure and column stays in `--json` (search.to_json);
`--wide` prints the full table (search.table) instead of the compact one."""

from __future__ import annotations

import tomllib
from dataclasses import fields, replace
from textwrap import wrap
from typing import TYPE_CHECKING, Any

from distrain.plan import search
from distrain.plan.comm_advice import TOLERANCE, CommAdvice, MethodPrediction
from distrain.plan.memory_model import model_of
from distrain.plan.search import GIB, NOT_PRICED, SOURCE_LABEL, PlanRow
from distrain.plan.timing import Candidate, Cluster

if TYPE_CHECKING:
    from distrain.config.schema import ModelConfig, ParallelConfig, TrainingConfig

WIDTH = 100
INDENT = " " * 17
"""Where a recommendation's name and reason start (after its label)."""


def layout_name(c: Candidate) -> str:
    """The parallel degrees above 1, compactly: 'dp8·tp2', 'fsdp16', 'pp2', 'fsdp4·cp2',
    'fsdp8·ep4', 'rg2·fsdp4'; '1 device' alone. dp is the replicated data-parallel degree (DDP,
    ZeRO-1), fsdp the sharded one (ZeRO-2/3); ep splits the experts over data-parallel ranks;
    rg counts replica groups (fault_tolerance.replica_groups), each its own torchrun."""
    degrees = (
        ("rg" if c.groups else "dp", c.dp_replicate),
        ("fsdp", c.dp_shard),
        ("tp", c.tp),
        ("cp", c.cp),
        ("pp", c.pp),
        ("ep", c.ep),
    )
    parts = [f"{name}{n}" for name, n in degrees if n > 1]
    return "·".join(parts) or "1 device"


def _count(n: float) -> str:
    units = ((1e9, "B"), (1e6, "M"), (1e3, "K"), (1, ""))
    scale, suffix = next((s, u) for s, u in units if n >= s)
    return f"{n / scale:.3g}{suffix}"


def _rate(per_s: float, unit: str) -> str:
    """'450 GB/s', '100 Mbit/s', '989 TFLOP/s': the value in its largest prefix of 1000."""
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")):
        if per_s >= scale:
            return f"{per_s / scale:.3g} {prefix}{unit}/s"
    return f"{per_s:.3g} {unit}/s"


def _size(n_bytes: float) -> str:
    return _rate(n_bytes, "B").removesuffix("/s") if n_bytes else "0 B"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def question(
    model: ModelConfig,
    t: TrainingConfig,
    cluster: Cluster,
    *,
    precision_given: bool,
    latency_s: float,
) -> list[str]:
    """The question the plan answers, as it read it: the model, the batch (`t`), the devices and
    their memory, the links and the precision (said to be the config's when not given)."""
    family = model_of(model)
    precision = t.precision if precision_given else f"{t.precision} (the config's; --precision)"
    devices = f"{_plural(cluster.nodes, 'node')} x {_plural(cluster.gpus_per_node, 'device')}"
    lines = [
        "plan for:",
        f"  model        {family.spec.name} {model.preset}, "
        f"{_count(family.num_params())} parameters, {precision}",
        f"  batch        {t.global_batch_size} sequences x {t.seq_len} tokens per step",
        f"  devices      {devices} of {cluster.memory_bytes / GIB:.3g} GiB "
        f"({cluster.memory_bytes / 1e9:.3g} GB), {_rate(cluster.peak_flops, 'FLOP')} peak "
        f"x {cluster.efficiency:.2f}",
        f"  links        {_rate(cluster.intra_bw, 'B')} per device inside a node",
    ]
    if cluster.nodes > 1:
        node_bits = cluster.inter_bw * cluster.gpus_per_node * 8
        lines.append(
            f"{' ' * 15}{_rate(node_bits, 'bit')} per node between nodes "
            f"({_rate(cluster.inter_bw, 'B')} per device), latency {latency_s * 1e6:.3g} us"
        )
    if cluster.concurrency < 1:
        lines.append(
            f"  overlap      a collective progresses {cluster.concurrency:.0%} as fast while its "
            "rank computes (calibrated)"
        )
    moe = family.spec.moe_settings(family.args)
    if moe is not None:
        lines += _experts(moe)
    return lines


def _experts(moe: Any) -> list[str]:
    """How the plan prices an expert-parallel rank's routed rows (`ExpertParallel._routes`), from
    the family's MoE settings (`moe_settings`)."""
    head = f"{moe.num_experts} routed, top {moe.top_k}"
    if moe.capacity_factor > 0:
        text = (
            f"{head}, capacity factor {moe.capacity_factor:g}: an ep rank priced for the most "
            "rows the capacity lets a router send it"
        )
    else:
        text = (
            f"{head}, dropless: an ep rank priced for a balanced router (a trained one can "
            "send it more; model.moe.capacity_factor bounds it, and the plan then prices the "
            "bound)"
        )
    return wrap(text, WIDTH, initial_indent="  experts      ", subsequent_indent=" " * 15)


def _item(label: str, name: str, why: str, *settings: str) -> list[str]:
    """A recommendation: its label and name, then why and the config that selects it, wrapped
    within WIDTH."""
    lines = [f"  {label + ':':<{len(INDENT) - 2}}{name}"]
    for text_line in (f"why: {why}", *(f"set: {words}" for words in settings)):
        lines += wrap(text_line, WIDTH, initial_indent=INDENT, subsequent_indent=INDENT + " " * 5)
    return lines


def recommendation(rows: list[PlanRow], parallel: ParallelConfig, cluster: Cluster) -> list[str]:
    """The layout, communication and micro-batch to use, one reason each: the layout with the
    fastest predicted step of those that fit (each priced with plain DDP/FSDP communication),
    the communication comm_advice.py recommends for it, and the micro-batch of that row; or why
    none fits. `parallel`: the config's, whose settings the recommended layout keeps."""
    best = next((r for r in rows if r.fits), None)
    if best is None:
        reason = rows[0].reason if rows else "no layout is valid for this cluster"
        return [f"no layout fits: the fastest one's {reason}; add devices or memory, or shrink"]
    c, peak = best.candidate, best.memory.get("peak", 0)
    checkpointing = "no" if c.activation_checkpointing == "none" else c.activation_checkpointing
    layout = f"{layout_name(c)}, ZeRO-{c.zero_stage}, {checkpointing} activation checkpointing"
    p = search.candidate_parallel(parallel, c)
    return [
        "recommended:",
        *_item(
            "layout",
            f"{layout} (row 1)",
            f"fastest step that fits (plain communication): {best.time.step_s:.3g} s; "
            f"peak {peak / GIB:.3g} of {cluster.memory_bytes / GIB:.3g} GiB",
            *_parallel_lines(c, p),
            f'[training] activation_checkpointing = "{c.activation_checkpointing}"',
        ),
        *_communication(best, cluster, p),
        *_item(
            "micro-batch",
            str(c.micro_batch_size),
            _micro_batch_reason(best, rows),
            f"[training] micro_batch_size = {c.micro_batch_size}",
        ),
    ]


def _parallel_lines(c: Candidate, p: ParallelConfig) -> list[str]:
    """The config lines of layout `c` (its parallel section `p`): replica groups are each a
    torchrun of the group's layout, counted by fault_tolerance.replica_groups."""
    if c.groups:
        return [
            f"[parallel] dp_shard = {p.dp_shard}, tp = {p.tp}, pp = {p.pp}, "
            f"zero_stage = {p.zero_stage}",
            f"[fault_tolerance] replica_groups = {c.groups} (a torchrun each, of "
            f"{_count_of(c.dp_shard * c.tp * c.pp, 'rank')})",
        ]
    extra = "".join(f", {name} = {n}" for name, n in (("cp", p.cp), ("ep", p.ep)) if n > 1)
    return [
        f"[parallel] dp_replicate = {p.dp_replicate}, dp_shard = {p.dp_shard}, tp = {p.tp}, "
        f"pp = {p.pp}, zero_stage = {p.zero_stage}{extra}"
    ]


def _count_of(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("s" if n != 1 else "")


def method_fields(m: MethodPrediction) -> dict[str, Any]:
    """The config fields (dotted name -> value) of a method's settings ("a.b = v, c.d = w");
    {} for plain communication, which sets nothing."""
    if m.method == "plain":
        return {}
    fields = {}
    for part in m.settings.split(", "):
        name, _, value = part.partition(" = ")
        fields[name] = tomllib.loads(f"v = {value}")["v"]
    return fields


def diloco_layout(c: Candidate, p: ParallelConfig, m: MethodPrediction) -> ParallelConfig | None:
    """The parallel section DiLoCo's prediction `m` runs on for layout `c` (its parallel section
    `p`): the same data-parallel ranks as parallel.dp_replicate sites of FSDP2 (ZeRO-3) shards;
    None when that is `p` itself or the ranks do not split so."""
    sites = method_fields(m).get("parallel.dp_replicate", 0)
    if m.method != "diloco" or not sites or c.dp % sites:
        return None
    if p.zero_stage == 3 and p.dp_replicate == sites:
        return None
    return replace(p, dp_replicate=sites, dp_shard=c.dp // sites, zero_stage=3)


def _communication(best: PlanRow, cluster: Cluster, p: ParallelConfig) -> list[str]:
    advice, c = best.communication, best.candidate
    if advice is None and c.groups:
        return _item(
            "communication",
            "the replica groups' own",
            f"each rank's gradient shard is all-reduced over the {c.groups} groups after "
            f"backward (torchft): {best.time.groups_comm_s:.3g} s a step; gradient compression "
            "and DiLoCo do not compose with replica groups",
        )
    if advice is None and c.ep > 1:
        return _item(
            "communication",
            "plain FSDP2",
            "expert parallelism runs on FSDP2, which has no place for the other methods' DDP "
            "communication hooks",
        )
    if advice is None:
        split = f"the layout splits the model over all {cluster.world_size} devices"
        if cluster.world_size == 1:
            split = "one device"
        return _item("communication", "none to choose", f"no data-parallel group: {split}")
    chosen = advice.recommended
    settings = () if chosen.method == "plain" else (chosen.settings,)
    own = diloco_layout(c, p, chosen)
    if own is not None:
        # DiLoCo runs on a layout of its own: stated as the alternative to the layout above,
        # never as settings that contradict it.
        return _item(
            "communication",
            method_label(chosen),
            f"{method_reason(advice)}; on a layout of its own, its sites the data-parallel "
            "replicas, FSDP2 (ZeRO-3) inside each: instead of the layout's [parallel] line",
            *_parallel_lines(c, own),
            f"[diloco] inner_steps = {chosen.inner_steps}",
        )
    return _item("communication", method_label(chosen), method_reason(advice), *settings)


def chosen_settings(rows: list[PlanRow], parallel: ParallelConfig) -> tuple[dict[str, Any], str]:
    """What writing the recommendation sets in the config the plan priced (whose [parallel]
    section is `parallel`), as dotted field names and values: `recommendation`'s layout and
    micro-batch, with the communication method when it runs on that layout; and a line saying
    what it holds. ConfigError when no layout fits."""
    from distrain.errors import ConfigError

    best = next((r for r in rows if r.fits), None)
    if best is None:
        raise ConfigError("no layout fits: there is no layout to write (see the answer)")
    c = best.candidate
    laid_out = search.candidate_parallel(parallel, c)
    settings: dict[str, Any] = {
        f"parallel.{f.name}": getattr(laid_out, f.name)
        for f in fields(laid_out)
        if getattr(laid_out, f.name) != getattr(parallel, f.name)
    }
    settings["training.micro_batch_size"] = c.micro_batch_size
    settings["training.activation_checkpointing"] = c.activation_checkpointing
    if c.groups:
        settings["fault_tolerance.replica_groups"] = c.groups
    held = f"layout {layout_name(c)} (row 1), ZeRO-{c.zero_stage}, micro-batch {c.micro_batch_size}"
    advice = best.communication
    if advice is None or advice.recommended.method == "plain":
        return settings, f"{held}, plain communication"
    chosen = advice.recommended
    if diloco_layout(c, laid_out, chosen) is not None:
        return settings, (
            f"{held}, plain communication (the advised {method_label(chosen)} runs on a layout "
            "of its own: its set: lines above)"
        )
    return settings | method_fields(chosen), f"{held}, {method_label(chosen)}"


def method_label(m: MethodPrediction) -> str:
    """'plain DDP', 'bf16 compression', 'PowerSGD', 'DiLoCo H=8', ... of one prediction."""
    labels = {
        "plain": "plain FSDP2" if m.settings.startswith("FSDP2") else "plain DDP",
        "bf16": "bf16 compression",
        "powersgd": "PowerSGD",
        "onebit": "1-bit",
        "onebit_adam": "1-bit Adam",
        "diloco": f"DiLoCo H={m.inner_steps}",
    }
    return labels[m.method]


def method_reason(advice: CommAdvice) -> str:
    """Why comm_advice.recommend chose its method: the fastest, or within TOLERANCE of it, and
    (not plain) what plain would take."""
    chosen = advice.recommended
    fastest = min(advice.methods, key=lambda m: m.step_s)
    plain = next(m for m in advice.methods if m.method == "plain")
    than_plain = "" if chosen is plain else f" (plain {plain.step_s:.3g} s)"
    if chosen.step_s <= fastest.step_s:
        return f"{chosen.step_s:.3g} s per step{than_plain}, the fastest method"
    return (
        f"{chosen.step_s:.3g} s per step{than_plain}, within {TOLERANCE:.0%} of the fastest, "
        f"{method_label(fastest)} {fastest.step_s:.3g} s"
    )


def _micro_batch_reason(best: PlanRow, rows: list[PlanRow]) -> str:
    c = best.candidate
    if c.pp > 1:
        bubble = best.time.bubble_s
        return f"fastest of this layout's: pipeline bubble {bubble:.3g} s, longer with larger ones"
    same = [
        r.candidate.micro_batch_size
        for r in rows
        if r.fits and r.candidate == replace(c, micro_batch_size=r.candidate.micro_batch_size)
    ]
    if max(same) == c.micro_batch_size:
        return "without pp the step model ignores it; no larger one fits"
    return f'without pp the step model ignores it; up to {max(same)} fits, "auto" finds the largest'


def table(rows: list[PlanRow], top: int) -> list[str]:
    """The `top` fastest layouts that fit, then the `top` fastest that do not, a line each;
    why a layout could not be evaluated below them."""
    header = (
        f"{'#':>3} {'layout':<14} {'zero':>4} {'ac':<4} {'mb':>3} {'peak GiB':>8} "
        f"{'memory':>6} {'step s':>7} {'comm s':>6} {'bubble':>6} {'tok/s':>9} {'MFU':>5}  fits"
    )
    lines = [
        "layouts (memory per rank from a fake build or the memory model; >: model states alone):",
        header,
        "-" * len(header),
    ]
    shown = [r for r in rows if r.fits][:top] + [r for r in rows if not r.fits][:top]
    errors = []
    for i, r in enumerate(shown, 1):
        c, m, t = r.candidate, r.memory, r.time
        peak = f"{m['peak'] / GIB:.2f}" if "peak" in m else f">{sum(m.values()) / GIB:.2f}"
        fits = "yes" if r.fits else "no" if m else "error"
        if r.memory_source == NOT_PRICED:
            peak = fits = "-"
        elif not m:
            peak = "-"
            errors.append(f"{i:>3} {r.reason}"[:WIDTH])
        lines.append(
            f"{i:>3} {layout_name(c):<14} {c.zero_stage:>4} {c.activation_checkpointing:<4} "
            f"{c.micro_batch_size:>3} {peak:>8} {SOURCE_LABEL[r.memory_source]:>6} "
            f"{t.step_s:7.3f} {t.exposed_comm_s:6.3f} {t.bubble_s:6.3f} {t.tokens_per_s:9.0f} "
            f"{t.mfu:5.2f}  {fits}"
        )
    return lines + errors


def unpriced(rows: list[PlanRow]) -> list[str]:
    """How many layouts the plan left unpriced (search.plan's `shown`), and how to price them;
    [] when none."""
    count = sum(r.memory_source == NOT_PRICED for r in rows)
    if not count:
        return []
    return wrap(
        f"{_plural(count, 'slower layout')} not priced: the rows shown did not need their "
        "memory model families (--all prices every layout).",
        WIDTH,
    )


def methods_table(rows: list[PlanRow], cluster: Cluster) -> list[str]:
    """Each data-parallel communication method predicted for the recommended layout (a line
    each, the recommended one marked); when that layout has no data-parallel group, for the
    fastest advised layout that has one. [] when no advised layout has one."""
    best = next((r for r in rows if r.fits), None)
    advised = next((r for r in rows if r.communication is not None), None)
    if best is None or advised is None:
        return []
    c = advised.candidate
    link = "between nodes" if c.tp * c.cp * c.dp > cluster.gpus_per_node else "inside a node"
    which = f"{layout_name(c)} ({link})"
    if advised is not best:
        rank = rows.index(advised) + 1
        which = (
            f"{layout_name(c)}, the fastest layout with data parallelism (ranked {rank}: "
            f"{advised.time.step_s:.3g} s with plain; {link})"
        )
    lines = wrap(
        f"communication methods for {which}, predicted per step with a latency per message "
        "(the layouts' step times leave it out):",
        WIDTH,
    )
    lines.append(f"  {'method':<18} {'step s':>7} {'sent/step':>10} {'exposed s':>9}")
    for m in advised.communication.methods:
        mark = "  <- recommended" if m is advised.communication.recommended else ""
        lines.append(
            f"  {method_label(m):<18} {m.step_s:7.3f} {_size(m.bytes_per_step):>10} "
            f"{m.exposed_comm_s:9.3f}{mark}"
        )
    return lines


def text(
    rows: list[PlanRow],
    cluster: Cluster,
    *,
    model: ModelConfig,
    training: TrainingConfig,
    parallel: ParallelConfig,
    top: int,
    precision_given: bool,
    latency_s: float,
    wide: bool = False,
) -> str:
    """The whole text answer (module docstring) for the config's `model`, `training` and
    `parallel` sections; `wide`: with search.table's every column."""
    parts = [
        question(model, training, cluster, precision_given=precision_given, latency_s=latency_s),
        recommendation(rows, parallel, cluster),
        methods_table(rows, cluster),
        search.table(rows, top).splitlines() if wide else table(rows, top),
        unpriced(rows),
    ]
    return "\n\n".join("\n".join(p) for p in parts if p)
