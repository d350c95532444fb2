"""Which gradient communication a layout should use on its inter-node link, and what each
method is predicted to cost: `advise` for a plan row, `predict_methods` for any data-parallel
group (a benchmark's 2 hosts).

Per optimizer step, each rank of a data-parallel group of n ranks sends (parallel/compress.py's
`wire_bytes`, the bandwidth-optimal algorithm of each collective), for P parameter values on the
rank (the model over tp x pp):

- plain: DDP's ring all-reduce of fp32 gradients, 2(n-1)/n x 4P; under ZeRO-2/3 FSDP2's
  reduce-scatter of them and all-gather of the parameters (twice under ZeRO-3), as timing.py;
- fp16/bf16 compression (comm.gradient_compression): the all-reduce at 2 bytes a value;
- PowerSGD (rank r): each gradient matrix m x k that PowerSGD shrinks (torch's rule: by more
  than 2x) as (m + k) r values, the others whole, fp32, in three all-reduces per bucket;
- 1-bit (comm.gradient_compression = onebit, and 1-bit Adam past its warm-up): a sign per value
  and a 4-byte scale per 2,048, all-to-all then all-gather: 2(n-1)/n x (P/8 + P/512);
- DiLoCo with H inner steps: sites are the nodes (parallel.dp_replicate = nodes, FSDP2 inside
  each over its devices' link); once every H steps each rank all-reduces its shard of the
  pseudo-gradient over the sites in diloco.sync_dtype: 2(s-1)/s x bytes x P / dp_shard, / H
  per step.

Time = bytes / bandwidth + latency x the collectives' ring steps. Overlap as timing.py has it: DDP's
hooks (plain, casts, PowerSGD, 1-bit) run during backward and hide behind its share of the compute,
as far as the ranks' concurrency lets them (timing.py's `hidden_s`); 1-bit Adam's exchange is in its
optimizer step and DiLoCo's outer step between steps, neither hidden. The recommendation is the
first method, in the order of METHODS (plain first; lossy gradient compressions after DiLoCo, whose
inner steps are exact optimizer steps: what error feedback delays costs them progress per step),
whose predicted step is within TOLERANCE of the fastest method's; DiLoCo takes the smallest H in
H_CHOICES (at most the run's steps) that brings its step within TOLERANCE of the step without
data-parallel communication.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from distrain.family.spec import FamilyModel
from distrain.parallel.compress import ONEBIT_BLOCK, wire_bytes
from distrain.plan.parameter_table import table
from distrain.plan.timing import Candidate, Cluster, hidden_s, step_time

METHODS = ("plain", "bf16", "diloco", "powersgd", "onebit", "onebit_adam")
TOLERANCE = 0.1
H_CHOICES = (2, 4, 8, 16, 32, 64, 128, 256, 512)
DEFAULT_LATENCY_S = 1e-4
SYNC_BYTES = {"fp32": 4, "bf16": 2}


@dataclass(frozen=True)
class MethodPrediction:
    """One communication method on one layout: what it sends and what the step takes."""

    method: str
    inner_steps: int
    """H for DiLoCo; 1 for the others."""
    bytes_per_step: float
    """Bytes each rank sends over the data-parallel link per optimizer step (DiLoCo: one outer
    step's bytes / H)."""
    comm_s: float
    exposed_comm_s: float
    step_s: float
    settings: str
    """The config that selects it."""

    def as_dict(self) -> dict[str, float | int | str]:
        return asdict(self)


@dataclass(frozen=True)
class CommAdvice:
    recommended: MethodPrediction
    methods: tuple[MethodPrediction, ...]

    def summary(self) -> str:
        """One line: the recommendation and, when it is not plain, what plain would take."""
        r = self.recommended
        name = f"DiLoCo H={r.inner_steps}" if r.method == "diloco" else r.method
        line = (
            f"{name} ({r.settings}): step {r.step_s:.3g} s, {r.bytes_per_step / 1e6:.3g} MB "
            f"sent per step, {r.exposed_comm_s:.3g} s exposed"
        )
        plain = next(m for m in self.methods if m.method == "plain")
        if r is not plain:
            line += f"; plain: {plain.step_s:.3g} s, {plain.bytes_per_step / 1e6:.3g} MB"
        return line

    def as_dict(self) -> dict:
        return {
            "recommended": self.recommended.as_dict(),
            "summary": self.summary(),
            "methods": [m.as_dict() for m in self.methods],
        }


def powersgd_values(model: FamilyModel, rank: int) -> int:
    """fp32 values PowerSGD all-reduces per step for the whole model's gradients: (m + k) r per
    matrix it compresses (torch's `_should_compress` at min_compression_rate 2), every other
    tensor whole."""
    total = 0
    for param in table(model).unique():
        values = math.prod(param.shape)
        if len(param.shape) < 2:
            total += values
            continue
        rows, cols = param.shape[0], values // param.shape[0]
        r = min(rank, rows, cols)
        compressed = (rows + cols) * r
        total += compressed if compressed * 2 < rows * cols else rows * cols
    return total


def _ring_latency(collectives: float, n: int, latency_s: float) -> float:
    return collectives * 2 * (n - 1) * latency_s if n > 1 else 0.0


def predict_methods(
    model: FamilyModel,
    *,
    compute_s: float,
    replicas: int,
    bandwidth: float,
    latency_s: float = DEFAULT_LATENCY_S,
    model_split: int = 1,
    other_s: float = 0.0,
    zero_stage: int = 0,
    bytes_per_value: int = 4,
    bucket_cap_mb: float = 25.0,
    powersgd_rank: int = 2,
    sites: int | None = None,
    site_bandwidth: float | None = None,
    sync_dtype: str = "fp32",
    max_inner_steps: int = H_CHOICES[-1],
    concurrency: float = 1.0,
) -> list[MethodPrediction]:
    """Each applicable method's prediction for a data-parallel group of `replicas` ranks joined
    by `bandwidth` (bytes/s per rank) with `latency_s` per message, a step computing for
    `compute_s` (plus `other_s` of other exposed time: tp, pipeline) on ranks holding 1 /
    `model_split` of the model, whose collectives progress at `concurrency` while they compute
    (timing.py's Cluster). DiLoCo runs `sites` sites (default: `replicas`, one rank each) of
    replicas / sites ranks joined inside a site by `site_bandwidth`."""
    n = replicas
    values = model.num_params() / model_split
    grad_bytes = 4 * values
    buckets = max(1, math.ceil(grad_bytes / (bucket_cap_mb * 2**20)))
    floor = compute_s + other_s
    hidden = hidden_s(compute_s, concurrency)

    def made(method: str, sent: float, comm: float, overlapped: bool, settings: str, h: int = 1):
        exposed = max(0.0, comm - hidden) if overlapped else comm
        return MethodPrediction(method, h, sent, comm, exposed, floor + exposed, settings)

    found = []
    if zero_stage >= 2:
        gathers = 2 if zero_stage == 3 else 1
        sent = (n - 1) / n * values * (4 + gathers * bytes_per_value) if n > 1 else 0.0
        latency = _ring_latency((model.shape.n_layers + 1) * (1 + gathers) / 2, n, latency_s)
        found.append(made("plain", sent, sent / bandwidth + latency, True, "FSDP2 as planned"))
    else:
        sent = wire_bytes("all_reduce", grad_bytes, n)
        latency = _ring_latency(buckets, n, latency_s)
        found.append(made("plain", sent, sent / bandwidth + latency, True, "DDP as planned"))
        sent = wire_bytes("all_reduce", 2 * values, n)
        found.append(
            made(
                "bf16",
                sent,
                sent / bandwidth + latency,
                True,
                "comm.gradient_compression = 'bf16'",
            )
        )
        sent = wire_bytes("all_reduce", 4 * powersgd_values(model, powersgd_rank) / model_split, n)
        found.append(
            made(
                "powersgd",
                sent,
                sent / bandwidth + 3 * latency,
                True,
                f"comm.gradient_compression = 'powersgd', comm.powersgd_rank = {powersgd_rank}",
            )
        )
    compressed = values / 8 + 4 * values / ONEBIT_BLOCK
    onebit_sent = wire_bytes("all_to_all", compressed, n) + wire_bytes(
        "all_gather", compressed / n, n
    )
    onebit_comm = onebit_sent / bandwidth + 2 * _ring_latency(buckets, n, latency_s)
    if zero_stage == 0:
        found.append(
            made("onebit", onebit_sent, onebit_comm, True, "comm.gradient_compression = 'onebit'")
        )
    if zero_stage <= 2:
        found.append(
            made("onebit_adam", onebit_sent, onebit_comm, False, "optim.name = 'onebit_adam'")
        )
    found += _diloco(
        values,
        n=n,
        sites=sites or n,
        bandwidth=bandwidth,
        site_bandwidth=site_bandwidth or bandwidth,
        latency_s=latency_s,
        floor=floor,
        hidden=hidden,
        bytes_per_value=bytes_per_value,
        sync_bytes=SYNC_BYTES[sync_dtype],
        max_inner_steps=max_inner_steps,
        n_layers=model.shape.n_layers,
    )
    return found


def _diloco(
    values: float,
    *,
    n: int,
    sites: int,
    bandwidth: float,
    site_bandwidth: float,
    latency_s: float,
    floor: float,
    hidden: float,
    bytes_per_value: int,
    sync_bytes: int,
    max_inner_steps: int,
    n_layers: int,
) -> list[MethodPrediction]:
    """DiLoCo at the smallest H that hides the outer step (module docstring); [] without two
    sites."""
    if sites < 2 or n % sites:
        return []
    shard = n // sites
    # FSDP2 (ZeRO-3) inside a site: reduce-scatter and two all-gathers over its link.
    inside = (shard - 1) / shard * values * (4 + 2 * bytes_per_value) if shard > 1 else 0.0
    inside_s = inside / site_bandwidth + _ring_latency(n_layers + 1, shard, latency_s)
    outer = wire_bytes("all_reduce", sync_bytes * values / shard, sites)
    outer_s = outer / bandwidth + _ring_latency(1, sites, latency_s)
    settings = f"parallel.dp_replicate = {sites}, parallel.zero_stage = 3"
    choices = [h for h in H_CHOICES if h <= max_inner_steps] or [H_CHOICES[0]]
    for h in choices:
        exposed = max(0.0, inside_s - hidden) + outer_s / h
        if floor + exposed <= (1 + TOLERANCE) * floor or h == choices[-1]:
            return [
                MethodPrediction(
                    "diloco",
                    h,
                    outer / h,
                    inside_s + outer_s / h,
                    exposed,
                    floor + exposed,
                    f"diloco.inner_steps = {h}, {settings}",
                )
            ]
    return []


def recommend(methods: list[MethodPrediction]) -> CommAdvice:
    """The first method of METHODS within TOLERANCE of the fastest (module docstring)."""
    fastest = min(m.step_s for m in methods)
    ranked = sorted(methods, key=lambda m: METHODS.index(m.method))
    chosen = next(m for m in ranked if m.step_s <= (1 + TOLERANCE) * fastest)
    return CommAdvice(recommended=chosen, methods=tuple(ranked))


def advise(
    c: Candidate,
    model: FamilyModel,
    cluster: Cluster,
    *,
    global_batch: int,
    seq_len: int,
    bytes_per_value: int,
    latency_s: float = DEFAULT_LATENCY_S,
    max_inner_steps: int = H_CHOICES[-1],
    sync_dtype: str = "fp32",
) -> CommAdvice:
    """The advice for plan row `c`: its data-parallel group crosses the inter-node link when it
    spans nodes (else the link inside a node), its compute and other exposed time are
    timing.py's."""
    t = step_time(
        c,
        model,
        cluster,
        global_batch=global_batch,
        seq_len=seq_len,
        bytes_per_value=bytes_per_value,
    )
    # The gradients are averaged over dp x cp (parallel/mesh.py).
    spans_nodes = c.tp * c.cp * c.dp > cluster.gpus_per_node
    bandwidth = cluster.inter_bw if spans_nodes else cluster.intra_bw
    nodes_in_group = max(1, c.tp * c.cp * c.dp // cluster.gpus_per_node)
    methods = predict_methods(
        model,
        compute_s=t.compute_s,
        replicas=c.dp * c.cp,
        bandwidth=bandwidth,
        latency_s=latency_s,
        model_split=c.tp * c.pp,
        other_s=t.step_s
        - t.compute_s
        - max(0.0, t.dp_comm_s - hidden_s(t.compute_s, cluster.concurrency)),
        zero_stage=c.zero_stage,
        bytes_per_value=bytes_per_value,
        sites=nodes_in_group if spans_nodes else None,
        site_bandwidth=cluster.intra_bw,
        sync_dtype=sync_dtype,
        max_inner_steps=max_inner_steps,
        concurrency=cluster.concurrency,
    )
    return recommend(methods)
