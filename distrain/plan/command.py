"""`distrain plan`: arguments -> cluster and base config -> ranked table (or JSON). The planner
(and torch) is imported when the command runs, not for its --help."""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, TextIO

from distrain.config.args import CommandParser
from distrain.config.io import load_config
from distrain.config.schema import Config
from distrain.errors import ConfigError, MissingInput

if TYPE_CHECKING:
    from distrain.plan.timing import Cluster

UNITS = {"": 1, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
# Dense bf16 peak of the common training GPU (H100 SXM) when nothing is calibrated.
DEFAULT_PEAK_FLOPS = 989e12
# The planner's defaults, restated so that --help imports no torch (test_plan_model.py checks).
VERIFIED = 1
DEFAULT_LATENCY_S = 1e-4


def quantity(text: str, what: str) -> float:
    """'80GB' -> 8e10, '80GiB' -> 80 x 2**30, '900GB/s' -> 9e11, '989T' -> 9.89e14."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]?)(i?)(B?)(?:/s)?\s*", text, re.IGNORECASE)
    if not m or (m.group(3) and not (m.group(2) and m.group(4))):
        raise ConfigError(f"{what}: cannot read {text!r}; write e.g. 80GB, 900GB/s or 989T")
    prefix = m.group(2).upper()
    scale = 1024 ** "KMGT".index(prefix) * 1024 if m.group(3) else UNITS[prefix]
    return float(m.group(1)) * scale


def memory_size(text: str, what: str) -> float:
    """Bytes of a memory size, which must say its unit: '80GB' -> 8e10, '80GiB' -> 80 x 2**30."""
    if not re.search(r"[KMGT]i?B\s*$", text, re.IGNORECASE):
        raise ConfigError(
            f"{what}: {text!r} has no unit; write it in GB or GiB (e.g. 80GB, 141GiB)"
        )
    return quantity(text, what)


def link_bandwidth(text: str, what: str) -> float:
    """Bytes/s of a link given in bits ('100Mbit', '1Gbit/s', '400Gbps') or bytes ('50GB/s')."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([KMGTkmgt]?)(?:bit|Bit|b)(?:/s|ps)?\s*", text)
    if m:
        return float(m.group(1)) * UNITS[m.group(2).upper()] / 8
    return quantity(text, what)


def interconnect(text: str) -> tuple[float, float]:
    parts = dict(p.split("=", 1) for p in text.split(",") if "=" in p)
    if set(parts) != {"intra", "inter"}:
        raise ConfigError("--interconnect: write intra=900GB/s,inter=50GB/s")
    return quantity(parts["intra"], "--interconnect"), quantity(parts["inter"], "--interconnect")


def parser() -> argparse.ArgumentParser:
    p = CommandParser(
        prog="distrain plan",
        description="Rank the layouts of a model on a cluster by step time, with memory per "
        "rank from a memory model calibrated by fake-tensor runs of the real build (the fastest "
        "layouts built that way), and the data-parallel communication to use for the best.",
    )
    p.add_argument(
        "--config", help="TOML config to plan (its model, batch, precision; default: defaults)."
    )
    p.add_argument(
        "--preset",
        help="Model preset (default: the config's model.preset); its family unless --family.",
    )
    p.add_argument("--family", help="Model family (default: the config's, or --preset's).")
    p.add_argument("--nodes", type=int, default=1, help="Nodes of the cluster.")
    p.add_argument("--gpus-per-node", type=int, default=8, help="Devices per node.")
    p.add_argument("--gpu-memory", default="80GB", help="Memory per device.")
    p.add_argument(
        "--seq-len", type=int, help="Tokens per sequence (default: the config's training.seq_len)."
    )
    p.add_argument(
        "--global-batch",
        type=int,
        help="Sequences per step (default: the config's training.global_batch_size).",
    )
    p.add_argument(
        "--precision",
        choices=("fp32", "bf16", "fp16"),
        help="Training precision (default: the config's training.precision).",
    )
    p.add_argument(
        "--interconnect",
        default="intra=450GB/s,inter=50GB/s",
        help="Bandwidth per device within a node (intra) and between nodes (inter).",
    )
    p.add_argument(
        "--inter-node-bandwidth",
        help="Network bandwidth of one node, shared by its devices, e.g. 100Mbit, 1Gbit, "
        "400Gbit (or 50GB/s): sets the inter value of --interconnect to it / --gpus-per-node.",
    )
    p.add_argument(
        "--inter-node-latency-us",
        type=float,
        default=DEFAULT_LATENCY_S * 1e6,
        help="Latency of one message between nodes, in microseconds (communication advice).",
    )
    p.add_argument("--peak", help="Peak FLOP/s per device (default: calibrated, else 989T).")
    p.add_argument("--efficiency", type=float, default=0.45, help="Achieved fraction of peak.")
    p.add_argument("--zero", default="0,1,2,3", help="ZeRO stages to search.")
    p.add_argument(
        "--checkpointing", default="none,full", help="Activation checkpointing to search."
    )
    p.add_argument("--top", type=int, default=10, help="Rows shown (each of fit / no fit).")
    p.add_argument("--json", action="store_true", help="Print JSON rows instead of a table.")
    p.add_argument(
        "--wide",
        action="store_true",
        help="Print every column of the table (memory per kind, parallel degrees apart; about "
        "200 columns) instead of the compact one.",
    )
    p.add_argument(
        "--exhaustive",
        action="store_true",
        help="Build every layout's model at full depth and every pipeline rank on fake "
        "tensors (slow; the default prices layouts with the calibrated memory model and builds "
        "the fastest few).",
    )
    p.add_argument(
        "--all",
        action="store_true",
        help="Price every layout's memory (the default prices the layouts the answer shows and "
        "the slower ones whose memory model family it calibrated for them; the rest are listed "
        "as not priced).",
    )
    p.add_argument(
        "--verify",
        type=int,
        default=VERIFIED,
        help="Fastest layouts predicted to fit whose memory a fake build then decides (default 1: "
        "the recommended one).",
    )
    p.add_argument(
        "--workers",
        type=int,
        help="Processes making the fake builds at once: the planning process and workers - 1 "
        "build workers (default: the cores this process may use; 1: all in the planning process).",
    )
    p.add_argument(
        "--write-config",
        metavar="FILE",
        help="Also write the recommended layout, micro-batch and communication (when it runs on "
        "that layout), with the config's model and batch, as a TOML config to FILE (a new "
        "file) for `distrain train --config FILE`.",
    )
    p.add_argument("--calibrate", action="store_true", help="Measure this machine and store it.")
    return p


def parse(argv: list[str]) -> argparse.Namespace:
    return parser().parse_args(argv)


def base_config(ns: argparse.Namespace, absent: list[str] | None = None) -> Config:
    """The config the plan prices: the file's, with the command's options over it. Planning
    reads no data: with `absent`, a data file, tokenizer or model.init_from folder that is not
    there is noted in it, and the plan goes on without it (model.preset's shape for a missing
    model.init_from; the tokenizer's vocabulary, which no plan reads, unchecked)."""
    from distrain.models.registry import family_of_preset

    fields = {"training.micro_batch_size": "1"}
    if ns.preset:
        fields["model.preset"] = ns.preset
        owner = family_of_preset(ns.preset)
        if owner is not None:
            fields["model.family"] = owner
    named = {
        "model.family": ns.family,
        "training.seq_len": ns.seq_len,
        "training.global_batch_size": ns.global_batch,
        "training.precision": ns.precision,
    }
    fields.update({key: str(value) for key, value in named.items() if value})
    cfg = load_config(ns.config, list(fields.items()))
    if absent is not None:
        from distrain.data.tokenizer import load_tokenizer
        from distrain.layout.rules import validate
        from distrain.models.hf_files import hf_dir

        validate(cfg, None, absent=absent)
        data, model = cfg.data, cfg.model
        if not _present(load_tokenizer, data.tokenizer):
            data = dataclasses.replace(data, tokenizer="bytes")
        if model.init_from and not _present(hf_dir, model.init_from):
            model = dataclasses.replace(model, init_from="")
        cfg = dataclasses.replace(cfg, data=data, model=model)
    return cfg


def _present(load: Callable[[str], object], spec: str) -> bool:
    try:
        load(spec)
    except MissingInput:
        return False
    return True


def cluster_of(ns: argparse.Namespace) -> Cluster:
    from distrain.plan.calibrate import load_calibration
    from distrain.plan.timing import Cluster

    intra, inter = interconnect(ns.interconnect)
    if ns.inter_node_bandwidth:
        inter = link_bandwidth(ns.inter_node_bandwidth, "--inter-node-bandwidth") / ns.gpus_per_node
    calibrated = load_calibration()
    concurrency = 1.0
    if ns.peak:
        peak, efficiency = quantity(ns.peak, "--peak"), ns.efficiency
    elif calibrated:  # devices like this machine's (calibrate.py)
        peak, efficiency = calibrated["peak_flops"], 1.0
        concurrency = calibrated.get("concurrency", 1.0)
    else:
        peak, efficiency = DEFAULT_PEAK_FLOPS, ns.efficiency
    return Cluster(
        nodes=ns.nodes,
        gpus_per_node=ns.gpus_per_node,
        memory_bytes=memory_size(ns.gpu_memory, "--gpu-memory"),
        peak_flops=peak,
        efficiency=efficiency,
        intra_bw=intra,
        inter_bw=inter,
        concurrency=concurrency,
    )


def progress_printer(stream: TextIO) -> Callable[[int, int], None] | None:
    """'evaluated 37/120 layouts' on one line of `stream` while the plan works, cleared at the
    end; None (nothing printed) when `stream` is not a terminal."""
    if not stream.isatty():
        return None

    def show(done: int, total: int) -> None:
        line = f"evaluated {done}/{total} layouts"
        stream.write("\r" + (line if done < total else " " * len(line) + "\r"))
        stream.flush()

    return show


def plan_command(argv: list[str]) -> None:
    ns = parse(argv)
    from distrain.plan.answer import text
    from distrain.plan.build_store import BuildStore
    from distrain.plan.build_workers import available_cores
    from distrain.plan.calibrate import cache_dir, calibrate
    from distrain.plan.memory_model import model_of
    from distrain.plan.search import plan, to_json, with_advice

    if ns.calibrate:
        found = calibrate()
        print(
            f"calibrated: matmul {found['peak_flops'] / 1e9:.1f} GFLOP/s, concurrency "
            f"{found['concurrency']:.2f} (share of a collective that progresses while computing)"
        )
        for kind, c in found["collectives"].items():
            print(
                f"  {kind}: latency {c['latency_s'] * 1e6:.0f} us, "
                f"{1 / c['s_per_byte'] / 1e9 if c['s_per_byte'] else float('inf'):.2f} GB/s "
                f"({c['group_size']} ranks)"
            )
        return
    if ns.workers is not None and ns.workers < 1:
        raise ConfigError(f"--workers: {ns.workers} processes; give 1 or more")
    if ns.write_config and os.path.lexists(ns.write_config):
        # Before the plan, which may take minutes; the write refuses it again (a new file only).
        raise ConfigError(f"--write-config {ns.write_config}: a file is there already")
    absent: list[str] = []
    cfg = base_config(ns, absent)
    for note in absent:
        print(f"not checked (absent here): {note}", file=sys.stderr)
    cluster = cluster_of(ns)
    bytes_per_value = 4 if cfg.training.precision == "fp32" else 2
    rows = plan(
        cfg,
        cluster,
        bytes_per_value=bytes_per_value,
        stages=tuple(int(s) for s in ns.zero.split(",")),
        checkpointing=tuple(ns.checkpointing.split(",")),
        exhaustive=ns.exhaustive,
        verify=ns.verify,
        workers=ns.workers or available_cores(),
        shown=None if ns.all or ns.exhaustive else ns.top,
        progress=progress_printer(sys.stderr),
        store=BuildStore(cache_dir() / "builds"),
    )
    latency_s = ns.inter_node_latency_us * 1e-6
    rows = with_advice(
        rows,
        model_of(cfg.model),
        cluster,
        training=cfg.training,
        diloco=cfg.diloco,
        bytes_per_value=bytes_per_value,
        latency_s=latency_s,
    )
    written = None
    if ns.write_config:
        from distrain.config.io import set_field, write_toml
        from distrain.plan.answer import chosen_settings

        chosen = base_config(ns)
        settings, held = chosen_settings(rows, chosen.parallel)
        for name, value in settings.items():
            set_field(chosen, name, value, from_text=False)
        write_toml(chosen, ns.write_config, replace=False)
        written = (
            f"wrote {ns.write_config}: {held}; check it with `distrain train --check --config "
            f"{ns.write_config} --world-size {cluster.world_size}`"
        )
    if ns.json:
        print(to_json(rows, ns.top))
        if written:
            print(written, file=sys.stderr)
        return
    given = ns.precision is not None
    print(
        text(
            rows,
            cluster,
            model=cfg.model,
            training=cfg.training,
            parallel=cfg.parallel,
            top=ns.top,
            precision_given=given,
            latency_s=latency_s,
            wide=ns.wide,
        )
    )
    if written:
        print(f"\n{written}")
