"""The planner's context-parallel (cp), expert-parallel (ep) and replica-group layouts: the fake
build of a cp or ep rank against the same rank on real tensors (2 gloo processes), a replica
group's stand-in against the group's own build, the memory model against the full fake build,
the layouts the search lists, their communication in the step-time model (hand-computed), and
the answer's config lines."""

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from helpers import layouts_of, process_group, real_step_memory

from distrain.config.schema import Config
from distrain.layout.rules import validate
from distrain.models.decoder.moe import moe_layers
from distrain.parallel import attention_blocks
from distrain.plan.answer import recommendation
from distrain.plan.built_rows import memory_of, memory_row
from distrain.plan.memory import (
    estimate_memory,
)
from distrain.plan.memory_model import calibrate_family, calibration_builds, modelled_row
from distrain.plan.planned import planned_run
from distrain.plan.search import candidate_plan, plan
from distrain.plan.timing import Candidate, Cluster, step_time


def _config(preset: str, seq_len: int, global_batch: int, parallel: dict) -> Config:
    """`preset` at 2 blocks on the CPU, eager, micro-batch 1, with these parallel fields."""
    cfg = Config()
    cfg.run.device = "cpu"
    cfg.model.preset, cfg.model.n_layers = preset, 2
    cfg.training.seq_len, cfg.training.global_batch_size = seq_len, global_batch
    cfg.training.compile, cfg.training.micro_batch_size = False, 1
    for key, value in parallel.items():
        setattr(cfg.parallel, key, value)
    return cfg


def moe_config(**parallel) -> Config:
    """moe-tiny (8 experts, top-2, dim 128) at 2 blocks."""
    return _config("moe-tiny", 64, 4, parallel)


def dense_config(**parallel) -> Config:
    """tiny at 2 blocks, sequences long enough that attention's activations count."""
    return _config("tiny", 256, 2, parallel)


REAL_CASES = {
    "ep2 zero2": lambda: moe_config(ep=2, zero_stage=2),
    "ep2 zero0": lambda: moe_config(ep=2, zero_stage=0),
    "cp2 ring zero2": lambda: dense_config(cp=2, cp_method="ring", zero_stage=2),
    "cp2 allgather zero3": lambda: dense_config(cp=2, cp_method="allgather", zero_stage=3),
}
MICRO_BATCH = 2
SKEWED_CAPACITY = 4.0
"""A capacity factor at which every copy a rank routes fits in the 4 experts of ep rank 0."""


def skewed_config() -> Config:
    """moe-tiny over ep 2 with a capacity (SKEWED_CAPACITY) and a selection bias
    (moe.balance "bias") that `route_to_rank_0` sets."""
    cfg = moe_config(ep=2, zero_stage=0)
    cfg.model.moe.capacity_factor = SKEWED_CAPACITY
    cfg.model.moe.balance = "bias"
    return cfg


def route_to_rank_0(model) -> None:
    """A router that sends every token's copies to the experts of ep rank 0 (0-3 of 8): their
    selection bias far above any router probability."""
    for part in model.parts:
        for layer in moe_layers(part):
            layer.expert_bias[: layer.expert_bias.numel() // 2] = 10.0


def _real_worker(rank: int, tmp_path: Path) -> None:
    """Each case's rank on real tensors: model states, and the peak above parameters and
    gradients of a step's first micro-batch (after a whole first step, gradients None), on
    random tokens (a router's load as training sees it, not all tokens alike); and ep 2 with
    every token routed to rank 0's experts."""
    with process_group(rank, 2, store_file=tmp_path / "store"):
        found = {}
        cases = {name: (make, None) for name, make in REAL_CASES.items()}
        cases["ep2 skewed"] = (skewed_config, route_to_rank_0)
        for name, (make, prepare) in cases.items():
            cfg = make()
            generator = torch.Generator().manual_seed(rank)
            vocab = validate(cfg, None).shape.vocab_size
            tokens = torch.randint(vocab, (MICRO_BATCH, cfg.training.seq_len), generator=generator)
            found[name] = real_step_memory(cfg, [(tokens, tokens)], prepare)
        (tmp_path / f"rank{rank}.json").write_text(json.dumps(found))


@pytest.fixture(scope="module")
def real_ranks(tmp_path_factory) -> list[dict]:
    """Each rank's measurements (`_real_worker`), rank 0 first."""
    folder = tmp_path_factory.mktemp("real_ranks")
    mp.spawn(_real_worker, args=(folder,), nprocs=2)
    return [json.loads((folder / f"rank{rank}.json").read_text()) for rank in (0, 1)]


@pytest.mark.slow
def test_fake_build_of_cp_and_ep_matches_real_ranks(real_ranks):
    """ep 2 (ZeRO-2 and ZeRO-0: experts split, then FSDP2 over the rest) and cp 2 (ring and
    all-gather) on 2 real ranks: each rank's model states and its activations within 5% of the
    fake build, which routes tokens as a balanced router would (measured: model states equal,
    activations 0.97-1.01 x)."""
    for rank in (0, 1):
        measured = real_ranks[rank]
        for name, make in REAL_CASES.items():
            planned = estimate_memory(planned_run(make(), 2), rank=rank)
            got = measured[name]
            for kind in ("params", "grads", "optimizer"):
                assert getattr(planned, kind) == pytest.approx(got[kind], rel=0.05), (name, kind)
            predicted = planned.activations(MICRO_BATCH, accumulating=False)
            assert predicted == pytest.approx(got["activations"], rel=0.05), (name, rank, got)
    # ep splits the experts: a rank holds less than without it, and cp less activation.
    whole = estimate_memory(planned_run(moe_config(zero_stage=0), 1))
    assert measured["ep2 zero0"]["params"] < 0.7 * whole.params
    alone = estimate_memory(planned_run(dense_config(zero_stage=0), 1))
    cp_activations = measured["cp2 ring zero2"]["activations"]
    assert cp_activations < 0.7 * alone.activations(MICRO_BATCH, accumulating=False)


@pytest.mark.slow
def test_an_ep_rank_is_priced_for_the_most_rows_its_capacity_lets_a_router_send(real_ranks):
    """With a capacity, the fake build of an ep rank receives from each peer the most rows the
    capacity lets a router send it (here: every row, at a factor of 4 over 2 ranks); measured on
    2 real ranks whose router sends every copy to rank 0's experts, rank 0's activations are
    within 5% of it, and over 1.2 x the price of a balanced router (the dropless price)."""
    rank0 = real_ranks[0]["ep2 skewed"]
    planned = estimate_memory(planned_run(skewed_config(), 2), rank=0)
    worst = planned.activations(MICRO_BATCH, accumulating=False)
    assert worst == pytest.approx(rank0["activations"], rel=0.05), rank0
    dropless = skewed_config()
    dropless.model.moe.capacity_factor = 0.0
    balanced = estimate_memory(planned_run(dropless, 2), rank=0)
    balanced = balanced.activations(MICRO_BATCH, accumulating=False)
    assert rank0["activations"] > 1.2 * balanced, (rank0, balanced)
    # Rank 1's experts receive nothing: below the balanced price.
    assert real_ranks[1]["ep2 skewed"]["activations"] < balanced


def _modelled_and_built(base: Config, c: Candidate) -> tuple[dict, dict]:
    world = c.dp * c.tp * c.cp * c.pp
    run, cache = candidate_plan(base, c, world), {}
    cfg = run.config
    coefficients = {}

    def family(f):
        if f not in coefficients:
            builds = calibration_builds(base, f)
            coefficients[f] = calibrate_family(f, builds, lambda b: memory_of(b, cache))
        return coefficients[f]

    modelled = modelled_row(
        world,
        family,
        model=cfg.model,
        parallel=cfg.parallel,
        training=cfg.training,
        optim=cfg.optim,
    )
    return modelled, memory_row(run, cache, exhaustive=True)


MODEL_ROWS = [
    ("moe", Candidate(1, 4, 1, 1, 2, "none", 2, ep=2)),
    ("moe", Candidate(1, 8, 1, 1, 3, "none", 1, ep=2)),
    ("moe", Candidate(8, 1, 1, 1, 0, "none", 2, ep=4)),
    ("moe", Candidate(1, 8, 1, 1, 2, "full", 2, ep=8)),
    ("moe", Candidate(1, 4, 1, 2, 2, "none", 2, ep=2)),
    ("moe", Candidate(2, 1, 1, 2, 0, "none", 2, ep=2)),
    ("dense", Candidate(1, 2, 1, 1, 2, "none", 2, cp=2)),
    ("dense", Candidate(1, 1, 2, 1, 3, "full", 1, cp=4)),
    ("dense", Candidate(1, 4, 1, 1, 3, "none", 1, cp=2)),
]


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "candidate"), MODEL_ROWS)
def test_memory_model_prices_cp_and_ep_as_the_full_build(kind, candidate):
    """The memory model (calibrated at 2 and 3 blocks, 2 x ep data-parallel ranks under ep)
    against the full fake build of 6 blocks: every kind within 5%, on layouts whose ep or
    FSDP2 degree differs from the calibration's, pp 2 x ep 2 among them."""
    base = moe_config() if kind == "moe" else dense_config()
    base.model.n_layers, base.training.global_batch_size = 6, 16
    modelled, built = _modelled_and_built(base, candidate)
    for key in ("params", "grads", "optimizer", "peak"):
        assert modelled[key] == pytest.approx(built[key], rel=0.05), (key, modelled, built)
    assert modelled["activations"] == pytest.approx(built["activations"], rel=0.05)


def test_search_lists_cp_for_dense_and_ep_for_moe_models():
    cluster = Cluster(1, 8, 80e9, 1e12, 0.5, 100e9, 10e9)
    dense, moe = dense_config(), moe_config()
    dense.training.global_batch_size = moe.training.global_batch_size = 16
    dense, moe = layouts_of(dense, cluster), layouts_of(moe, cluster)
    assert {c.cp for c in dense} == {1, 2, 4, 8}
    assert {c.ep for c in dense} == {1}
    assert {c.ep for c in moe} == {1, 2, 4, 8}
    # MoE does not compose with cp; cp is not searched with pp and runs on FSDP2; ep is
    # searched with pp, not with ZeRO-1; tp x cp inside the node.
    assert {c.cp for c in moe} == {1}
    assert any(c.ep > 1 and c.pp > 1 for c in moe)
    for c in dense + moe:
        world = c.dp * c.tp * c.cp * c.pp
        assert world == 8 and c.tp * c.cp <= 8
        if c.cp > 1:
            assert c.pp == 1 and c.zero_stage >= 2
        if c.ep > 1:
            assert c.zero_stage != 1 and c.dp % c.ep == 0


def test_cp_and_ep_exchanges_in_the_step_time():
    """cp: each block's keys and values of the rank's chunk, (cp - 1) hops, 3 passes (4 with
    full checkpointing); ep: each token's top_k copies, out and back in forward and backward,
    (ep - 1) / ep of them leaving the rank; both on the critical path."""
    cluster = Cluster(1, 8, 80e9, 1e12, 0.5, 100e9, 10e9)
    dense = validate(dense_config(), None).family_model
    c = Candidate(1, 2, 1, 1, 2, "full", 1, cp=4)
    t = step_time(c, dense, cluster, global_batch=2, seq_len=256, bytes_per_value=2)
    shape = dense.shape
    local_tokens = 2 * 256 // (2 * 4)
    kv = 2 * shape.n_layers * local_tokens * shape.kv_width * 2
    assert t.cp_comm_s == pytest.approx(4 * 3 * kv / 100e9)
    assert t.ep_comm_s == 0
    moe = validate(moe_config(), None).family_model
    c = Candidate(1, 8, 1, 1, 2, "none", 1, ep=4)
    t = step_time(c, moe, cluster, global_batch=16, seq_len=64, bytes_per_value=2)
    rows = 16 * 64 // 8 * moe.shape.top_k
    a2a = 4 * len(moe.shape.moe_layers) * rows * moe.shape.dim * 2
    assert t.ep_comm_s == pytest.approx(0.75 * a2a / 100e9)
    assert t.cp_comm_s == 0
    assert t.exposed_comm_s >= t.ep_comm_s
    # The experts' gradients are reduced over the dp / ep ranks holding the same experts.
    whole = dataclasses.replace(c, ep=1)
    assert (
        t.dp_comm_s
        < step_time(whole, moe, cluster, global_batch=16, seq_len=64, bytes_per_value=2).dp_comm_s
    )


@pytest.mark.slow
def test_plan_of_an_moe_model_evaluates_its_ep_layouts():
    """examples/moe-ep.toml's model on 4 devices: every row shown is evaluated (the fake build of
    an ep layout, capacity routing included, runs), and an ep layout fits."""
    cfg = moe_config()
    cfg.model.n_layers, cfg.training.global_batch_size = 4, 16
    cfg.model.moe.capacity_factor = 1.25
    cluster = Cluster(1, 4, 1e9, 1e12, 0.5, 100e9, 10e9)
    rows = plan(cfg, cluster, shown=3, stages=(0, 2), checkpointing=("none",), verify=2)
    shown = [r for r in rows if r.fits][:3] + [r for r in rows if not r.fits][:3]
    assert all(not r.reason.startswith("not evaluated") for r in shown), [r.reason for r in shown]
    assert any(r.fits and r.candidate.ep > 1 for r in rows)
    assert math.isfinite(rows[0].time.step_s)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ring", "allgather"])
def test_fake_cp_attention_runs_the_largest_blocks_for_the_same_peak(monkeypatch, method):
    """On fake tensors the blockwise attention computes only its largest unmasked and masked
    blocks (a long sequence has thousands): the build equals, to the byte, the one that computes
    every block, at a length of several blocks per chunk."""
    cfg = dense_config(cp=2, cp_method=method, zero_stage=2)
    cfg.model.n_layers, cfg.training.seq_len = 1, 4096
    cfg.model.max_seq_len = 4096
    reduced = estimate_memory(planned_run(cfg, 2))
    monkeypatch.setattr(attention_blocks, "_blocks_to_run", lambda plan, q: plan)
    assert estimate_memory(planned_run(cfg, 2)) == reduced


def replica_group_config() -> Config:
    cfg = dense_config(zero_stage=3)
    cfg.training.seq_len, cfg.training.global_batch_size = 128, 16
    cfg.fault_tolerance.replica_groups = 2
    cfg.fault_tolerance.lighthouse = "http://localhost:29510"
    return cfg


def test_search_lists_replica_groups_as_fsdp_groups():
    """Under fault_tolerance.replica_groups = 2 on 8 devices every layout is 2 groups of 4
    ranks, FSDP2 (ZeRO-2/3) inside each (one data-parallel rank too), without cp or ep."""
    rows = layouts_of(replica_group_config(), Cluster(2, 4, 80e9, 1e12, 0.5, 100e9, 1e9))
    assert rows and {(c.groups, c.dp_replicate) for c in rows} == {(2, 2)}
    assert {c.zero_stage for c in rows} == {2, 3}
    assert {c.dp_shard for c in rows} == {1, 2, 4}
    for c in rows:
        assert c.dp_shard * c.tp * c.pp == 4 and c.cp == c.ep == 1


@pytest.mark.parametrize(("stage", "ac"), [(2, "none"), (3, "full")])
def test_replica_groups_are_priced_as_one_group(stage, ac):
    """A replica-group row is built as HSDP over the groups (its config passes the layout
    rules, which refuse dp_replicate beside replica groups): every figure equals, to the byte,
    the build of one group on its own ranks."""
    c = Candidate(2, 2, 1, 1, stage, ac, 2, groups=2)
    stand_in = candidate_plan(replica_group_config(), c, 4)
    group = dataclasses.replace(
        stand_in.config,
        parallel=dataclasses.replace(stand_in.config.parallel, dp_replicate=1, dp_shard=2),
        training=dataclasses.replace(stand_in.config.training, global_batch_size=8),
    )
    assert estimate_memory(stand_in) == estimate_memory(planned_run(group, 2))


def test_replica_groups_exchange_and_answer():
    """The groups' all-reduce of each rank's fp32 gradient shard, after backward, between
    nodes; the average's two flat copies of the gradients in the peak; the answer sets
    replica_groups and the group's own layout."""
    cfg = replica_group_config()
    cluster = Cluster(2, 1, 80e9, 1e12, 0.5, 100e9, 1e9)
    model = validate(cfg, None).family_model
    c = Candidate(2, 1, 1, 1, 2, "none", 1, groups=2)
    t = step_time(c, model, cluster, global_batch=16, seq_len=128, bytes_per_value=4)
    assert t.groups_comm_s == pytest.approx(2 * 0.5 * 4 * model.num_params() / 1e9)
    assert t.dp_comm_s == 0  # one rank per group: nothing to reduce inside it
    assert t.exposed_comm_s == pytest.approx(t.groups_comm_s)
    rows = plan(cfg, cluster, shown=2, stages=(2,), checkpointing=("none",), verify=1)
    best = rows[0]
    grads = best.memory["grads"]
    held = sum(best.memory[k] for k in ("params", "grads", "optimizer"))
    assert best.candidate.groups == 2 and best.memory["peak"] >= held + 2 * grads
    text = "\n".join(recommendation(rows, cfg.parallel, cluster))
    assert "[fault_tolerance] replica_groups = 2 (a torchrun each, of 1 rank)" in text
    assert "dp_replicate" not in text
