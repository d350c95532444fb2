"""The parity matrix: every supported layout reproduces the 1-process fp32 loss curve, and its
validation loss at the last step (the same held-out samples on every layout and world size).

Layouts are data: each entry names its world size and config overrides. Every run uses the
same seed and global batch (8 sequences of 64 tokens) as the in-process reference; only the
layout differs. Tolerance 1e-5 relative: sharded reductions sum fp32 values in another order
(reduce-scatter, row-parallel partial sums, pipeline micro-batch accumulation), which moves the
loss by ~1e-7 per step; 1e-5 leaves room for 6 AdamW steps of that drift and nothing more (a
real bug, e.g. a missing gradient reduction or a wrong scaling, moves it by 1e-3 or more).
"""

from dataclasses import dataclass
from pathlib import Path

import pytest
from batch import Run, pool_name
from helpers import (
    cli_in_process,
    losses,
    overrides,
    run_cli,
    train_cli,
    train_in_process,
    val_losses,
)

from distrain.observe.metrics import read_metrics

STEPS = 6
BASE = {
    "training__steps": STEPS,
    "training__global_batch_size": 8,
    "training__seq_len": 64,
    "training__micro_batch_size": 2,
    "checkpoint__interval_steps": 0,
    "checkpoint__at_end": False,
    "training__eval_interval_steps": STEPS,
}
REL_TOL = 1e-5


@dataclass(frozen=True)
class Layout:
    name: str
    nproc: int
    fields: dict
    model: tuple[tuple[str, object], ...] = ()
    """Model overrides, given to the 1-process reference too (a tied model has its own curve, so
    does bf16)."""
    rel_tol: float = REL_TOL


TIED = (("model__tie_embeddings", True),)
# bf16 against the 1-process bf16 run: the cp ranks' blockwise attention rounds its bf16 partial
# results in another order than one whole-sequence attention. Measured worst 3.2e-5 relative
# over the 6 steps (1.2e-5 at step 1, before any update: the forward's rounding alone); 2e-4
# leaves 6x room and still fails a real bug (1e-3 or more, see the module docstring).
BF16 = (("training__precision", "bf16"),)
BF16_REL_TOL = 2e-4
# Packed samples masked by document, each line of the corpus one document: micro-batches then
# hold unequally many targets, and the loss is their mean over the global batch.
DOCUMENTS = (("data__document_masking", True), ("data__eos_id", ord("\n")))
# The qwen3 family (query/key norms, heads wider than dim / n_heads, a tied head), 4 blocks so
# the interleaved schedule has a block per stage.
QWEN3 = (("model__family", "qwen3"), ("model__preset", "qwen3-tiny"), ("model__n_layers", 4))
# The llama family (grouped-query attention, SwiGLU, untied head), the gpt2 family (LayerNorm and
# linears with biases, learned positions, a tied head) and the mixtral family (top-2 of 4 SwiGLU
# experts in every block), 4 blocks each as Qwen3's.
LLAMA = (("model__family", "llama"), ("model__preset", "llama-tiny"), ("model__n_layers", 4))
GPT2 = (("model__family", "gpt2"), ("model__preset", "gpt2-tiny"), ("model__n_layers", 4))
# Its balancing loss is counted per micro-batch: its reference routes the same micro-batches of 2.
MIXTRAL4 = (
    ("model__family", "mixtral"),
    ("model__preset", "mixtral-tiny"),
    ("model__n_layers", 4),
    ("training__micro_batch_size", 2),
)
# Every family of model.family on every kind of layout, against its own 1-process run.
FAMILY_MODELS = {"qwen3": QWEN3, "llama": LLAMA, "gpt2": GPT2, "mixtral": MIXTRAL4}
FAMILY_LAYOUTS = {
    "dp2": {},
    "zero3x2": {"parallel__zero_stage": 3},
    "tp2_sp": {"parallel__tp": 2},
    "pp2_1f1b": {"parallel__pp": 2, "parallel__pp_schedule": "1f1b"},
    "pp2_interleaved_1f1b": {
        "parallel__pp": 2,
        "parallel__pp_schedule": "interleaved_1f1b",
        "parallel__pp_stages_per_rank": 2,
    },
    "cp2": {"parallel__cp": 2},
}


LAYOUTS = [
    Layout("dp2", 2, {"debug__check_replicas": True}),
    Layout("dp2_no_accumulation", 2, {"training__micro_batch_size": 4}),
    Layout("zero1x2", 2, {"parallel__zero_stage": 1}),
    Layout("zero2x2", 2, {"parallel__zero_stage": 2}),
    Layout("zero3x2", 2, {"parallel__zero_stage": 3}),
    # Op-level selective checkpointing recomputes the cheap ops and keeps the collectives'
    # outputs; tp2 with sp is where a recomputed collective would desynchronize the ranks.
    Layout(
        "tp2_sp_selective_op",
        2,
        {"parallel__tp": 2, "training__activation_checkpointing": "selective_op"},
    ),
    Layout("tp2_no_sp", 2, {"parallel__tp": 2, "parallel__sequence_parallel": False}),
    Layout("pp2_gpipe", 2, {"parallel__pp": 2, "parallel__pp_schedule": "gpipe"}),
    Layout("pp2_1f1b", 2, {"parallel__pp": 2, "parallel__pp_schedule": "1f1b"}),
    Layout(
        "pp2_interleaved_1f1b",
        2,
        {
            "parallel__pp": 2,
            "parallel__pp_schedule": "interleaved_1f1b",
            "parallel__pp_stages_per_rank": 2,
        },
    ),
    # Once refused (torch's split weight backward lost a block's gradients under data
    # parallelism); 2e-7 measured with torch 2.13 and FSDP2 over dp2.
    Layout(
        "pp2_zero_bubble_zero3x2",
        4,
        {
            "parallel__pp": 2,
            "parallel__pp_schedule": "zero_bubble",
            "parallel__pp_stages_per_rank": 2,
            "parallel__zero_stage": 3,
        },
    ),
    Layout("zero1x2_tp2", 4, {"parallel__tp": 2, "parallel__zero_stage": 1}),
    Layout("zero3x2_tp2", 4, {"parallel__tp": 2, "parallel__zero_stage": 3}),
    Layout(
        "hsdp2x2",
        4,
        {"parallel__zero_stage": 3, "parallel__dp_replicate": 2, "debug__check_replicas": True},
    ),
    Layout("pp2_tp2_sp_tied", 4, {"parallel__pp": 2, "parallel__tp": 2}, TIED),
    Layout("pp2_zero1x2_tied", 4, {"parallel__pp": 2, "parallel__zero_stage": 1}, TIED),
    Layout(
        "pp2_zero3_dp2_tp2_sp",
        8,
        {"parallel__pp": 2, "parallel__tp": 2, "parallel__zero_stage": 3, "parallel__dp_shard": 2},
    ),
    Layout("cp2_compile", 2, {"parallel__cp": 2, "training__compile": True}),
    Layout("cp2_bf16", 2, {"parallel__cp": 2}, BF16, BF16_REL_TOL),
    Layout("cp2_dp2", 4, {"parallel__cp": 2, "parallel__zero_stage": 3}),
    Layout("cp2_tp2", 4, {"parallel__cp": 2, "parallel__tp": 2}),
    Layout("cp2_ring", 2, {"parallel__cp": 2, "parallel__cp_method": "ring"}),
    Layout("dp2_document_masking", 2, {}, DOCUMENTS),
    Layout("pp2_1f1b_document_masking", 2, {"parallel__pp": 2}, DOCUMENTS),
    Layout(
        "cp2_ring_document_masking",
        2,
        {"parallel__cp": 2, "parallel__cp_method": "ring"},
        DOCUMENTS,
    ),
    Layout(
        "cp2_ring_dp2",
        4,
        {"parallel__cp": 2, "parallel__cp_method": "ring", "parallel__zero_stage": 3},
    ),
    # Each stage gets its columns' global positions from a hook (the schedule passes it only
    # its input); FSDP2 shards over cp and ZeRO-1 (Zero1AdamW) over dp2.
    Layout("cp2_pp2_zero1x2", 8, {"parallel__cp": 2, "parallel__pp": 2, "parallel__zero_stage": 1}),
    # ZeRO-1's state sharded over dp x cp (4 ranks) under DDP with the hierarchical hook (one
    # node here: a reduce to its first rank, then a broadcast), both over dp x cp.
    Layout(
        "cp2_dp2_zero1_hierarchical",
        4,
        {"parallel__cp": 2, "parallel__zero_stage": 1, "comm__hierarchical": True},
    ),
    *(
        Layout(f"{family}_{name}", 2, fields, model)
        for family, model in FAMILY_MODELS.items()
        for name, fields in FAMILY_LAYOUTS.items()
        # An MoE model under cp is refused (tests/test_validation.py): its balancing losses
        # are not reduced over the cp ranks.
        if not (family == "mixtral" and name == "cp2")
    ),
    # Mixtral's experts split over the data-parallel ranks (MoE routing groups the same
    # micro-batches of 2 as its 1-process run).
    Layout("mixtral_ep2_zero3x2", 2, {"parallel__ep": 2, "parallel__zero_stage": 3}, MIXTRAL4),
]


# Mixture-of-experts rows, each against the 1-process run of the same MoE model with the same
# micro-batch (capacity and the balancing losses are counted per micro-batch, so the reference
# must route the same groups of tokens). The bias row also proves the load all-reduce: a rank
# updating its bias from its own load alone would route differently by step 2. The balancing
# terms move the 4-layer model's curve by 1.5e-3 relative (aux and z loss coefficients 0 vs
# these), so a layout that lost them fails the 1e-5 bound.
MOE_MODELS = {
    "top2_capacity_aux": {
        "model__preset": "moe-tiny",
        "model__n_layers": 2,
        "model__moe__capacity_factor": 1.0,
        "model__moe__z_loss_coef": 1e-3,
    },
    # Four MoE blocks: four pipeline stages (pp2 x 2 stages per rank) of one each.
    "top2_capacity_aux_4_layers": {
        "model__preset": "moe-tiny",
        "model__moe__capacity_factor": 1.0,
        "model__moe__z_loss_coef": 1e-3,
    },
    "top1_capacity_bias": {
        "model__preset": "switch-tiny",
        "model__n_layers": 2,
        "model__moe__balance": "bias",
        "model__moe__bias_update_rate": 1e-2,
    },
}
MOE_LAYOUTS = [
    ("top2_capacity_aux", Layout("dp2", 2, {"debug__check_replicas": True})),
    ("top2_capacity_aux", Layout("zero3x2", 2, {"parallel__zero_stage": 3})),
    ("top1_capacity_bias", Layout("dp2", 2, {})),
    # MoE layers replicated over tp (no ep); under SP each gathers the sequence, so capacity
    # and the balancing losses count the micro-batch's every token as on one process.
    ("top2_capacity_aux", Layout("tp2_sp_dp2", 4, {"parallel__tp": 2})),
    # tp alone: no data-parallel wrapper turns the MoE layers' plain parameters into DTensors,
    # so the optimizer steps them in groups of their own (optim.by_tensor_kind).
    ("top2_capacity_aux", Layout("tp2_sp", 2, {"parallel__tp": 2})),
    # Two stages per rank, each joining its own balancing term to its own backward; zero
    # bubble splits that backward into its input and weight halves.
    (
        "top2_capacity_aux_4_layers",
        Layout(
            "pp2_zero_bubble",
            2,
            {
                "parallel__pp": 2,
                "parallel__pp_schedule": "zero_bubble",
                "parallel__pp_stages_per_rank": 2,
            },
        ),
    ),
    # Everything at once: interleaved stages, tp with SP, experts split over ep2.
    (
        "top2_capacity_aux_4_layers",
        Layout(
            "pp2_interleaved_tp2_sp_ep2",
            8,
            {
                "parallel__pp": 2,
                "parallel__tp": 2,
                "parallel__ep": 2,
                "parallel__pp_schedule": "interleaved_1f1b",
                "parallel__pp_stages_per_rank": 2,
            },
        ),
    ),
]


@pytest.fixture(scope="module")
def moe_reference(tmp_path_factory):
    """The 1-process loss curve of each MoE model, computed when a row first needs it."""
    curves: dict[str, dict[int, float]] = {}

    def curve(model: str) -> dict[int, float]:
        if model not in curves:
            run = tmp_path_factory.mktemp(f"ref_{model}") / "run"
            curves[model] = losses(train_in_process(run, **BASE, **MOE_MODELS[model]))
        return curves[model]

    return curve


@pytest.fixture(scope="module")
def reference_rows(tmp_path_factory):
    """The 1-process metrics rows for a model override (`Layout.model`), each trained once."""
    rows: dict[tuple, list[dict]] = {}

    def of(model: tuple[tuple[str, object], ...] = ()) -> list[dict]:
        if model not in rows:
            run = tmp_path_factory.mktemp("ref") / "run"
            fields = {**BASE, "training__micro_batch_size": 8, **dict(model)}
            rows[model] = train_in_process(run, **fields)
        return rows[model]

    return of


@pytest.fixture(scope="module")
def references(reference_rows):
    """The 1-process loss curve for a model override (`Layout.model`)."""

    def curve(model: tuple[tuple[str, object], ...] = ()) -> dict[int, float]:
        return losses(reference_rows(model))

    return curve


@pytest.fixture(scope="module")
def reference(references):
    return references()


def assert_parity(got: dict[int, float], want: dict[int, float], rel_tol: float = REL_TOL) -> None:
    assert got.keys() == want.keys()
    worst = max(abs(got[s] - want[s]) / abs(want[s]) for s in want)
    assert worst <= rel_tol, f"relative loss difference {worst:.2e} > {rel_tol}: {got} vs {want}"


def batched_runs(names: set[str]) -> dict[str, Run]:
    """The rows of every matrix in this file that this session selected (`names`), by case."""
    rows = {f"test_layout_matches_single_process[{layout.name}]": layout for layout in LAYOUTS}
    runs = {
        name: Run(layout.nproc, {**BASE, **layout.fields, **dict(layout.model)})
        for name, layout in rows.items()
    }
    for model, layout in MOE_LAYOUTS:
        name = f"test_moe_layout_matches_single_process[{model}-{layout.name}]"
        runs[name] = Run(layout.nproc, {**BASE, **MOE_MODELS[model], **layout.fields})
    for layout in EP_LAYOUTS:
        name = f"test_expert_parallel_matches_single_process[{layout.name}]"
        runs[name] = Run(layout.nproc, {**BASE, **EP_ROUTES[layout.route], **layout.fields})
    return {name: run for name, run in runs.items() if name in names}


@pytest.fixture(scope="module")
def batched(batch_pool):
    """The run dir of this case's row, once it trained without error. The rows run in the
    session's torchrun launch of their world size (tests/batch.py's pool), started by the first
    case of the session that needs one of its runs."""

    def run_dir(node: pytest.Item) -> Path:
        return batch_pool.trained(pool_name(__name__, node.name))

    return run_dir


# The rows of the compat suite (.ci/run: also on the oldest and newest torch): DDP, ZeRO-1,
# FSDP2, tp + sp with op-level selective recomputation, a pipeline, context and expert parallel.
COMPAT_LAYOUTS = {
    "dp2",
    "zero1x2",
    "zero3x2",
    "tp2_sp_selective_op",
    "pp2_1f1b",
    "llama_cp2",
    "mixtral_ep2_zero3x2",
}


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [
        pytest.param(layout, marks=[pytest.mark.compat] if layout.name in COMPAT_LAYOUTS else [])
        for layout in LAYOUTS
    ],
    ids=[layout.name for layout in LAYOUTS],
)
def test_layout_matches_single_process(layout, reference_rows, batched, request):
    rows = read_metrics(batched(request.node) / "metrics.jsonl")
    want = reference_rows(layout.model)
    assert_parity(losses(rows), losses(want), layout.rel_tol)
    # The validation set is the same samples whatever the layout: the 1-process loss.
    assert list(val_losses(want)) == [STEPS]
    assert_parity(val_losses(rows), val_losses(want), layout.rel_tol)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("model", "layout"), MOE_LAYOUTS, ids=[f"{m}-{layout.name}" for m, layout in MOE_LAYOUTS]
)
def test_moe_layout_matches_single_process(model, layout, moe_reference, batched, request):
    rows = read_metrics(batched(request.node) / "metrics.jsonl")
    assert any(r.get("moe_dropped_fraction", 0) > 0 for r in rows)  # capacity dropped some
    assert_parity(losses(rows), moe_reference(model))


@pytest.mark.compat
@pytest.mark.slow
def test_resume_across_layouts(references, tmp_path):
    """A tied-embedding model, tp2 -> dp2 (ZeRO-1) -> pp2 x dp2 (embedding and head on different
    stages, each with its copy) -> 1 process: each attempt resumes the last one's checkpoint
    under a new layout, and the stitched loss curve is the uninterrupted 1-process curve. The
    attempts save in the background (a writer thread, a writer process, a thread): a crash
    gives the save in flight time to commit, so each resumes the step before its crash."""
    run = tmp_path / "run"
    steps = (("training__steps", 8),)
    fields = dict(BASE, **dict(TIED + steps), checkpoint__interval_steps=2)
    thread, process = {"checkpoint__async_mode": "thread"}, {"checkpoint__async_mode": "process"}
    first = train_cli(run, 2, **fields, **thread, parallel__tp=2, debug__fail_at_step=3)
    assert first.returncode != 0
    second = train_cli(run, 2, **fields, **process, parallel__zero_stage=1, debug__fail_at_step=5)
    assert second.returncode != 0
    third = train_cli(
        run, 4, **fields, **thread, parallel__pp=2, parallel__zero_stage=3, debug__fail_at_step=7
    )
    assert third.returncode != 0
    assert "resumed from" in third.stderr and "step-00000004" in third.stderr, third.stderr[-3000:]
    rows = train_in_process(run, **dict(fields, training__micro_batch_size=8))
    assert [r["resumed_from"] for r in rows if "resumed_from" in r][-1] == 6
    assert_parity(losses(rows), references(TIED + steps))


MIXTRAL = (("model__family", "mixtral"), ("model__preset", "mixtral-tiny"))


@pytest.mark.compat
@pytest.mark.slow
@pytest.mark.parametrize(
    ("model", "layout"),
    [
        (QWEN3, {"parallel__tp": 2, "checkpoint__async_mode": "thread"}),
        (
            MIXTRAL,
            {"parallel__ep": 2, "parallel__zero_stage": 3, "checkpoint__async_mode": "process"},
        ),
        (LLAMA, {"parallel__pp": 2, "checkpoint__async_mode": "thread"}),
        (GPT2, {"parallel__zero_stage": 3, "checkpoint__async_mode": "process"}),
    ],
    ids=["qwen3_tp2", "mixtral_ep2_zero3", "llama_pp2", "gpt2_zero3"],
)
def test_a_family_resumes_on_another_layout(model, layout, references, tmp_path):
    """Each family's checkpoint is layout-independent too: 2 ranks (Qwen3 under tp2, Mixtral's
    experts split under ep2, Llama in 2 pipeline stages, GPT-2 sharded by ZeRO-3) stop at step
    3 with a checkpoint of step 2, one process resumes it, and the stitched curve is the
    uninterrupted 1-process curve; the 2-rank runs save in the background (a writer thread or
    process), so the staged copy of DTensors and pipeline stages is what resumes. Micro-batches
    of 2 throughout: MoE balancing losses are counted per micro-batch, so the reference routes
    the same groups."""
    run = tmp_path / "run"
    model = (*model, ("training__micro_batch_size", 2))
    fields = dict(BASE, **dict(model), checkpoint__interval_steps=2)
    first = train_cli(run, 2, **fields, **layout, debug__fail_at_step=3)
    assert first.returncode != 0
    rows = train_in_process(run, **fields)
    assert [r["resumed_from"] for r in rows if "resumed_from" in r][-1] == 2
    assert_parity(losses(rows), references(model))


@pytest.mark.parametrize(
    "fields",
    [
        {"training__activation_checkpointing": "full"},
        {"training__activation_checkpointing": "selective", "training__ac_every_layers": 2},
        {"training__activation_checkpointing": "selective_op"},
    ],
    ids=["full", "selective", "selective_op"],
)
def test_activation_checkpointing_changes_nothing(fields, reference, tmp_path):
    # Recomputation replays the same fp32 ops on the same inputs: bit-identical in practice;
    # the bound allows reordering by the allocator only.
    got = losses(
        train_in_process(tmp_path / "run", **dict(BASE, training__micro_batch_size=8), **fields)
    )
    assert_parity(got, reference)


@pytest.mark.slow
def test_compile_changes_nothing_beyond_rounding(reference, tmp_path):
    # Inductor fuses kernels and reassociates fp32 sums: ~1e-6 relative per step here.
    got = losses(
        train_in_process(
            tmp_path / "run", **dict(BASE, training__micro_batch_size=8), training__compile=True
        )
    )
    assert_parity(got, reference)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("nproc", "fields", "expected"),
    [
        (2, {"parallel__tp": 2, "model__vocab_size": 255}, "model.vocab_size (255)"),
        (
            2,
            {
                "parallel__pp": 2,
                "parallel__pp_stages_per_rank": 4,
                "parallel__pp_schedule": "interleaved_1f1b",
            },
            "model.n_layers",
        ),
    ],
    ids=["tp_vocab", "pp_too_many_stages"],
)
def test_unsupported_shapes_are_refused(nproc, fields, expected, tmp_path, capsys):
    # Refused by the launcher's layout rules, before any worker starts: in this process.
    args = ["train", "--nproc", str(nproc)]
    for key, value in overrides(tmp_path / "run", **BASE, **fields):
        args += [f"--{key}", value]
    result = cli_in_process(capsys, *args)
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("distrain: error:")]
    assert errors and expected in errors[0], result.stderr[-3000:]


# Expert parallelism (parallel.ep): a tiny MoE model (4 experts in blocks 1 and 3, a shared
# expert) compared with the 1-process run of the same model, in micro-batches of 2 like the
# rows (capacity and the balancing losses are counted per forward call, so the reference must
# see the same micro-batches). Each row covers several features: routing (top-1 with capacity,
# top-2 dropless), the ZeRO stage, check_replicas, and the axis ep composes with.
EP_MOE = {
    "model__moe__num_experts": 4,
    "model__moe__every": 2,
    "model__moe__shared_experts": 1,
    "model__moe__ffn_dim": 128,
}
EP_ROUTES = {
    "top1_capacity": dict(EP_MOE, model__moe__top_k=1, model__moe__capacity_factor=1.0),
    "top2_dropless": dict(EP_MOE, model__moe__top_k=2, model__moe__capacity_factor=0),
}


@dataclass(frozen=True)
class ExpertLayout:
    name: str
    nproc: int
    route: str
    fields: dict


EP_LAYOUTS = [
    ExpertLayout(
        "ep2_top1_capacity", 2, "top1_capacity", {"parallel__ep": 2, "debug__check_replicas": True}
    ),
    ExpertLayout("ep4_top2_dropless", 4, "top2_dropless", {"parallel__ep": 4}),
    ExpertLayout(
        "ep2_tp2_top1_capacity",
        4,
        "top1_capacity",
        {"parallel__ep": 2, "parallel__tp": 2, "parallel__sequence_parallel": False},
    ),
    # HSDP 2 x 2: ep takes the dp_shard ranks, experts are FSDP-sharded over dp_replicate.
    ExpertLayout(
        "ep2_zero3_hsdp_top2_dropless",
        4,
        "top2_dropless",
        {
            "parallel__ep": 2,
            "parallel__zero_stage": 3,
            "parallel__dp_replicate": 2,
            "debug__check_replicas": True,
        },
    ),
    # ZeRO-1: the dense weights replicated with their optimizer state split over the 4
    # data-parallel ranks; each rank steps its own experts (split over ep2, FSDP over 2).
    ExpertLayout(
        "ep2_zero1x4_top1_capacity",
        4,
        "top1_capacity",
        {"parallel__ep": 2, "parallel__zero_stage": 1, "debug__check_replicas": True},
    ),
    ExpertLayout(
        "pp2_ep2_top2_dropless",
        4,
        "top2_dropless",
        {"parallel__pp": 2, "parallel__ep": 2, "parallel__pp_schedule": "gpipe"},
    ),
]


@pytest.fixture(scope="module")
def ep_reference(tmp_path_factory):
    """The 1-process curve of each MoE route, computed once per route."""
    curves: dict[str, dict[int, float]] = {}

    def curve(route: str) -> dict[int, float]:
        if route not in curves:
            run = tmp_path_factory.mktemp(f"ep_ref_{route}") / "run"
            curves[route] = losses(train_in_process(run, **BASE, **EP_ROUTES[route]))
        return curves[route]

    return curve


@pytest.mark.slow
@pytest.mark.parametrize("layout", EP_LAYOUTS, ids=[layout.name for layout in EP_LAYOUTS])
def test_expert_parallel_matches_single_process(layout, ep_reference, batched, request):
    rows = read_metrics(batched(request.node) / "metrics.jsonl")
    assert_parity(losses(rows), ep_reference(layout.route))
    # Rows were routed to other ranks and back: the all-to-all bytes are counted, at most
    # every routed copy of rank 0's tokens (fp32 rows of dim 128) sent out and back, in each
    # MoE layer rank 0 holds (2, or 1 per pipeline stage).
    tp, pp = layout.fields.get("parallel__tp", 1), layout.fields.get("parallel__pp", 1)
    tokens = BASE["training__global_batch_size"] * BASE["training__seq_len"] * tp * pp
    top_k = EP_ROUTES[layout.route]["model__moe__top_k"]
    bound = 2 * top_k * (tokens // layout.nproc) * 128 * 4 * (2 // pp)
    # (Less the layout's own collectives, FSDP2's, recorded apart from the second step on.)
    sent = [row["comm_bytes"] - row.get("comm_layout_bytes", 0) for row in rows if "loss" in row]
    assert len(sent) == STEPS and all(0 < b <= bound for b in sent), sent


@pytest.mark.slow
def test_resume_across_expert_parallel_degrees(ep_reference, tmp_path):
    """ep2 with ZeRO-1 -> ep1 (plain DDP) -> ep4: each attempt resumes the last one's
    checkpoint, the expert weights and their optimizer state resharded, and the stitched curve
    is the 1-process curve; the ep4 checkpoint then loads in `distrain generate` (one
    process)."""
    run = tmp_path / "run"
    fields = dict(BASE, **EP_ROUTES["top1_capacity"], checkpoint__interval_steps=2)
    first = train_cli(
        run, 2, **fields, parallel__ep=2, parallel__zero_stage=1, debug__fail_at_step=3
    )
    assert first.returncode != 0
    second = train_cli(run, 2, **fields, debug__fail_at_step=5)
    assert second.returncode != 0
    third = train_cli(run, 4, **fields, parallel__ep=4)
    assert third.returncode == 0, third.stderr[-3000:]
    assert "resumed from" in third.stderr and "step-00000004" in third.stderr
    assert_parity(losses(read_metrics(run / "metrics.jsonl")), ep_reference("top1_capacity"))
    sample = run_cli("generate", "--run-dir", str(run), "--prompt", "def ", "--max-new-tokens", "9")
    assert sample.returncode == 0 and sample.stdout.startswith("def "), sample.stderr[-3000:]
