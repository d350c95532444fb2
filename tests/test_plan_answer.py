"""`distrain plan`'s text answer (distrain/plan/answer.py) on layouts priced by the step-time
model alone (memory not planned: every row fits), and the advice at the communication guide's
100 Mbit/s example: which layout it recommends and what it says of data parallelism there."""

import dataclasses
import re
import shlex
import textwrap
from pathlib import Path

import pytest
from helpers import layouts_of

from distrain.layout.rules import validate
from distrain.plan.answer import (
    WIDTH,
    layout_name,
    method_label,
    methods_table,
    question,
    recommendation,
    text,
)
from distrain.plan.comm_advice import TOLERANCE
from distrain.plan.command import base_config, cluster_of, parse, plan_command
from distrain.plan.search import PlanRow, with_advice
from distrain.plan.timing import Candidate, step_time

GUIDE = Path(__file__).resolve().parent.parent / "docs" / "guides" / "choosing-a-layout.md"


def guide_example() -> tuple[list[str], str]:
    """The guide's two hosts of one device on 100 Mbit/s: the command's arguments and the part
    of its answer the guide shows."""
    page = GUIDE.read_text()
    command = re.search(r"^ +distrain plan (.*\\\n.*--inter-node-bandwidth 100Mbit)$", page, re.M)
    shown = re.search(r"across the link, not DiLoCo:\n\n((?: {8}.*\n|\n)+?)\n  \S", page)
    assert command and shown, "the guide's 100 Mbit/s example moved"
    return shlex.split(command.group(1).replace("\\\n", " ")), textwrap.dedent(shown.group(1))


SLOW_LINK, SHOWN = guide_example()


def priced(argv: list[str], *, fits: bool = True):
    """The config, cluster and rows of `argv`'s plan, ranked by step time as `plan` ranks them
    (micro-batches up to its cap), each with `fits` and a peak of 1 GiB, advised as the command
    advises them."""
    ns = parse(argv)
    cfg, cluster = base_config(ns), cluster_of(ns)
    model = validate(cfg, None).family_model
    t = cfg.training
    rows = [
        PlanRow(
            c,
            {"peak": 2**30},
            step_time(
                c,
                model,
                cluster,
                global_batch=t.global_batch_size,
                seq_len=t.seq_len,
                bytes_per_value=4,
            ),
            fits,
            "" if fits else "peak 1.0 GiB > 0.5 GiB per device",
        )  # fmt: skip
        for c in layouts_of(cfg, cluster)
        if c.micro_batch_size <= 16
    ]
    rows.sort(key=lambda r: r.time.step_s)
    advice = dict(training=t, diloco=cfg.diloco, bytes_per_value=4)
    return cfg, cluster, with_advice(rows, model, cluster, **advice)


def test_at_100_mbit_the_plan_splits_the_model_across_the_link_and_advises_diloco_for_dp():
    """The guide's example: pp2 (only activations cross the link) is the fastest layout and has
    no data-parallel group, so no method is advised for it; for the fastest data-parallel
    layout, dp2, DiLoCo is. pp2's step is within TOLERANCE of dp2's fastest method (PowerSGD,
    lossy): the exact layout is the one to use."""
    cfg, cluster, rows = priced(SLOW_LINK)
    best = rows[0]
    assert (best.candidate.pp, best.candidate.dp) == (2, 1)
    assert best.communication is None
    dp = next(r for r in rows if r.candidate.dp > 1)
    assert layout_name(dp.candidate) == "dp2" and dp.communication is not None
    assert dp.communication.recommended.method == "diloco"
    fastest = min(dp.communication.methods, key=lambda m: m.step_s)
    assert fastest.method == "powersgd" and fastest.step_s < best.time.step_s
    assert best.time.step_s <= (1 + TOLERANCE) * fastest.step_s
    assert dp.communication.recommended.step_s > best.time.step_s

    said = "\n".join(recommendation(rows, cfg.parallel, cluster))
    assert "  layout:        pp2, ZeRO-0, no activation checkpointing (row 1)" in said
    assert "  communication: none to choose\n" in said
    assert "no data-parallel group" in said
    methods = methods_table(rows, cluster)
    assert methods[0].startswith("communication methods for dp2, the fastest layout with data")
    marked = [line for line in methods if line.endswith("<- recommended")]
    assert len(marked) == 1 and marked[0].split()[:2] == ["DiLoCo", "H=32"]


def test_the_answer_fits_in_width_and_names_the_first_row():
    """Question, recommendation, methods and table within WIDTH columns; the recommendation
    names the first row's layout, ZeRO stage and micro-batch, and its advised method, the one
    marked in the methods table; --wide prints the full table instead."""
    argv = "--preset 1b --nodes 4 --gpus-per-node 8 --seq-len 2048 --global-batch 512".split()
    cfg, cluster, rows = priced(argv)
    sections = dict(model=cfg.model, training=cfg.training, parallel=cfg.parallel)
    said = text(rows, cluster, **sections, top=10, precision_given=False, latency_s=1e-4)
    lines = said.splitlines()
    assert max(len(line) for line in lines) <= WIDTH
    assert lines[1] == "  model        gpt 1b, 1.04B parameters, fp32 (the config's; --precision)"
    assert "  devices      4 nodes x 8 devices of 74.5 GiB (80 GB), 989 TFLOP/s peak" in said
    best = rows[0]
    c = best.candidate
    checkpointing = "no" if c.activation_checkpointing == "none" else c.activation_checkpointing
    assert (
        f"  layout:        {layout_name(c)}, ZeRO-{c.zero_stage}, {checkpointing} activation "
        "checkpointing (row 1)"
    ) in lines
    assert f"  micro-batch:   {c.micro_batch_size}" in lines
    assert f"set: [training] micro_batch_size = {c.micro_batch_size}" in said
    chosen = method_label(best.communication.recommended)
    assert f"  communication: {chosen}" in lines
    marked = [line for line in lines if line.endswith("<- recommended")]
    assert len(marked) == 1 and marked[0].startswith(f"  {chosen} ")
    first = lines[lines.index(next(x for x in lines if x.startswith("  # layout"))) + 2]
    assert first.split()[:5] == [
        "1", layout_name(c), str(c.zero_stage), c.activation_checkpointing,
        str(c.micro_batch_size),
    ]  # fmt: skip

    sections = dict(model=cfg.model, training=cfg.training, parallel=cfg.parallel)
    wide = text(rows, cluster, **sections, top=10, precision_given=True, latency_s=1e-4, wide=True)
    assert "dp_rep dp_shd" in wide and max(len(line) for line in wide.splitlines()) > WIDTH
    assert "fp32 (the config's" not in wide


def test_layout_names_and_a_plan_without_a_fit():
    assert layout_name(Candidate(8, 1, 2, 1, 1, "none", 1)) == "dp8·tp2"
    assert layout_name(Candidate(1, 16, 1, 2, 3, "none", 1)) == "fsdp16·pp2"
    assert layout_name(Candidate(1, 1, 1, 1, 0, "none", 1)) == "1 device"
    cfg, cluster, rows = priced(SLOW_LINK, fits=False)
    assert all(r.communication is None for r in rows)
    assert recommendation(rows, cfg.parallel, cluster) == [
        "no layout fits: the fastest one's peak 1.0 GiB > 0.5 GiB per device; add devices or "
        "memory, or shrink"
    ]
    assert methods_table(rows, cluster) == []
    one = "--preset tiny --nodes 1 --gpus-per-node 1 --seq-len 32 --global-batch 2".split()
    cfg, cluster, rows = priced(one)
    said = recommendation(rows, cfg.parallel, cluster)
    assert "  layout:        1 device, ZeRO-0, no activation checkpointing (row 1)" in said
    assert " " * 17 + "why: no data-parallel group: one device" in said
    assert methods_table(rows, cluster) == []


@pytest.mark.slow
def test_the_guide_shows_what_the_plan_prints(capsys):
    """The guide's sample of the 100 Mbit/s answer is the command's (memory planned too)."""
    plan_command(SLOW_LINK)
    assert SHOWN.strip() in capsys.readouterr().out


@pytest.mark.parametrize(
    ("preset", "said"),
    [
        ("tiny", None),
        ("moe-tiny", "8 routed, top 2, dropless: an ep rank priced for a balanced router"),
        ("switch-tiny", "8 routed, top 1, capacity factor 1.25: an ep rank priced for the most"),
    ],
)
def test_the_question_says_how_an_moe_models_routed_rows_are_priced(preset, said):
    """An MoE model's question names its routing and how an ep rank is priced: the most a
    capacity lets a router send it, or a balanced router when dropless (which a trained router
    can exceed); a dense model's has no such line."""
    ns = parse(["--preset", preset, "--gpus-per-node", "8", "--gpu-memory", "80GB"])
    cfg = base_config(ns)
    lines = question(cfg.model, cfg.training, cluster_of(ns), precision_given=True, latency_s=1e-5)
    experts = [line for line in lines if line.startswith("  experts")]
    if said is None:
        assert experts == []
    else:
        assert experts and experts[0].startswith(f"  experts      {said}"), lines
        assert max(len(line) for line in lines) <= WIDTH


def test_the_question_names_a_calibrated_concurrency():
    """Ranks whose collectives slow down while they compute (a calibrated CPU machine) are
    named in the question; a GPU cluster's full overlap is not."""
    ns = parse(["--preset", "tiny", "--gpus-per-node", "2", "--peak", "100G"])
    cfg, cluster = base_config(ns), cluster_of(ns)
    said = question(cfg.model, cfg.training, cluster, precision_given=True, latency_s=1e-5)
    assert not any(line.startswith("  overlap") for line in said)
    slowed = dataclasses.replace(cluster, concurrency=0.3)
    lines = question(cfg.model, cfg.training, slowed, precision_given=True, latency_s=1e-5)
    overlap = [line for line in lines if line.startswith("  overlap")]
    assert overlap == [
        "  overlap      a collective progresses 30% as fast while its rank computes (calibrated)"
    ]
    assert max(len(line) for line in lines) <= WIDTH


def test_advice_that_needs_another_layout_states_it_as_an_alternative():
    """Where DiLoCo (sites of FSDP2 shards, ZeRO-3) is advised for a ZeRO-0 layout, its set:
    lines are the whole alternative [parallel] line, said to replace the layout's, never a
    zero_stage beside the layout's that contradicts it."""
    cfg, cluster, rows = priced(
        "--preset tiny --nodes 2 --gpus-per-node 2 --gpu-memory 1GB".split()
    )
    assert rows[0].communication.recommended.method == "diloco"
    assert rows[0].candidate.zero_stage == 0
    said = "\n".join(recommendation(rows, cfg.parallel, cluster))
    layout, communication = said.split("  communication: ")[0], said.split("  communication: ")[1]
    assert "zero_stage = 0" in layout and "zero_stage = 3" not in layout
    assert "parallel.zero_stage" not in said  # the contradicting fragment of before
    sets = [line.split("set: ", 1)[1] for line in communication.splitlines() if "set: " in line]
    assert sets[0].startswith("[parallel] dp_replicate = 2, dp_shard = 1, tp = 1, pp = 2")
    assert sets[0].endswith("zero_stage = 3") and sets[1].startswith("[diloco] inner_steps = ")
    assert "instead of the layout's [parallel] line" in " ".join(communication.split())
