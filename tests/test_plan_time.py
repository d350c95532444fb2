"""The planner's step-time model for this machine: the alpha-beta fit of collective costs, the
collectives a probed step records (against the model's own parameter bytes), and the predicted
step time from given probe and calibration figures (hand-computed). Measured-vs-predicted step
times are a benchmark (benchmarks/plan.py --measure), not a test: they depend on the machine's
load."""

import json
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from helpers import layouts_of, process_group, real_step_memory

from distrain.config.schema import Config
from distrain.models.decoder.counts import num_params
from distrain.models.registry import model_args
from distrain.plan.build_results import in_flight
from distrain.plan.built_rows import memory_row
from distrain.plan.calibrate import calibrate, collective_costs, load_calibration
from distrain.plan.collectives import KINDS, LinkCost, fit
from distrain.plan.command import cluster_of, parse
from distrain.plan.pipeline_memory import estimate_pipeline_memory
from distrain.plan.planned import planned_run
from distrain.plan.probe import Collective, Probe, predicted_time, probe, probe_together
from distrain.plan.timing import Cluster


def tiny_config(**parallel) -> Config:
    cfg = Config()
    cfg.run.device = "cpu"
    cfg.model.dim, cfg.model.n_layers, cfg.model.n_heads, cfg.model.ffn_dim = 64, 2, 4, 256
    cfg.training.seq_len = 32
    cfg.training.micro_batch_size = 1
    cfg.training.global_batch_size = 4
    for key, value in parallel.items():
        setattr(cfg.parallel, key, value)
    return cfg


def test_fit_recovers_latency_and_bandwidth():
    sizes = [1e3, 1e4, 1e5, 1e6]
    cost = fit(sizes, [50e-6 + s * 2e-9 for s in sizes], group_size=2)
    assert cost.latency_s == pytest.approx(50e-6)
    assert cost.s_per_byte == pytest.approx(2e-9)
    # A negative intercept (noise) is refit through the origin, never a negative latency.
    through_origin = fit(sizes, [s * 3e-9 - 1e-6 for s in sizes], group_size=2)
    assert through_origin.latency_s == 0.0
    assert through_origin.s_per_byte == pytest.approx(3e-9, rel=1e-3)
    # Noise that hides the byte term (times falling with size) never makes bytes free.
    noisy = fit(sizes, [1.3e-3, 1.1e-3, 1.2e-3, 1.0e-3], group_size=2)
    assert noisy.latency_s == pytest.approx(1.0e-3)
    assert noisy.s_per_byte == pytest.approx(0.3e-3 / (1e6 - 1e3))
    assert noisy.seconds(2**24, 2) > noisy.seconds(0, 2)


def test_ring_scaling_from_the_measured_group():
    cost = LinkCost(latency_s=1e-4, s_per_byte=1e-9, group_size=2)
    assert cost.seconds(1e6, 2) == pytest.approx(1e-4 + 1e-3)
    # 4 ranks: 3 ring steps instead of 1, each rank moves 3/4 of the message instead of 1/2.
    assert cost.seconds(1e6, 4) == pytest.approx(3e-4 + 1e-3 * 1.5)
    assert cost.seconds(1e6, 1) == 0.0


COSTS = {kind: LinkCost(latency_s=1e-4, s_per_byte=1e-9, group_size=2) for kind in KINDS}


def test_predicted_time_adds_collectives_to_the_probed_compute():
    p = Probe(
        compute_s=0.5,
        collectives=(Collective("all_reduce", 1_000_000, 2), Collective("all_gather", 4, 2)),
    )
    t = predicted_time(p, COSTS, tokens_per_step=1000)
    comm = (1e-4 + 1e-3) + (1e-4 + 4e-9)
    assert t.comm_s == pytest.approx(comm)
    assert t.step_s == pytest.approx(0.5 + comm)
    assert t.tokens_per_s == pytest.approx(1000 / (0.5 + comm))
    assert t.bubble_s == 0.0


def test_predicted_pipeline_time_has_the_bubble_and_boundary_traffic():
    # 2 ranks, 1 stage each, 4 microbatches of 0.1 s on the slowest rank, 0.05 s optimizer step.
    p = Probe(
        compute_s=0.05,
        collectives=(),
        pp=2,
        stages_per_rank=1,
        microbatches=4,
        microbatch_s=0.1,
        boundary_bytes=100_000,
    )
    t = predicted_time(p, COSTS, tokens_per_step=1)
    assert t.bubble_s == pytest.approx(0.1)  # (p - 1) / v microbatch times
    assert t.comm_s == pytest.approx(2 * 4 * (1e-4 + 1e-4))  # activation + gradient, each mb
    assert t.step_s == pytest.approx(0.05 + 4 * 0.1 + 0.1 + 8 * 2e-4)
    interleaved = predicted_time(
        Probe(0.05, (), pp=2, stages_per_rank=2, microbatches=4, microbatch_s=0.1),
        COSTS,
        tokens_per_step=1,
    )
    assert interleaved.bubble_s == pytest.approx(0.05)


def test_zero3_probe_records_fsdp_traffic_of_the_model_bytes():
    """Under ZeRO-3 every parameter is all-gathered for forward and again for backward in each
    micro-batch, and its gradient reduce-scattered once per step (the last micro-batch)."""
    cfg = tiny_config(zero_stage=3)
    found = probe(planned_run(cfg, 2), repeats=1)
    param_bytes = 4 * num_params(model_args(cfg.model))
    micro_batches = 2  # global 4 / dp 2 / micro-batch 1
    gathered = sum(c.nbytes for c in found.collectives if c.kind == "all_gather")
    scattered = sum(c.nbytes for c in found.collectives if c.kind == "reduce_scatter")
    assert gathered == 2 * micro_batches * param_bytes
    assert scattered == param_bytes
    assert {c.group_size for c in found.collectives} == {2}
    assert found.compute_s > 0


def test_tp_probe_records_functional_collectives_on_their_group():
    """DTensor issues functional collectives, which name their group rather than carry it: each
    is priced on the tp group (2 ranks), an all-gather at its output's bytes. Tensor parallel
    all-reduces one activation [micro-batch, seq, dim] per block twice in forward (attention and
    MLP outputs) and twice in backward (their inputs' gradients), in each micro-batch."""
    cfg = tiny_config(tp=2)
    found = probe(planned_run(cfg, 2), repeats=1)
    activation = 4 * cfg.training.micro_batch_size * cfg.training.seq_len * cfg.model.dim
    micro_batches = 4  # global 4 / micro-batch 1
    reduced = [c for c in found.collectives if c.kind == "all_reduce" and c.nbytes == activation]
    assert len(reduced) == 4 * cfg.model.n_layers * micro_batches
    assert {c.group_size for c in found.collectives} == {2}
    gathers = [c for c in found.collectives if c.kind == "all_gather"]
    assert gathers and all(c.nbytes == activation for c in gathers)


def test_ddp_probe_counts_one_all_reduce_per_bucket():
    cfg = tiny_config()
    cfg.comm.bucket_cap_mb = 0.25
    found = probe(planned_run(cfg, 2), repeats=1)
    grad_bytes = 4 * num_params(model_args(cfg.model))
    buckets = [c for c in found.collectives if c.kind == "all_reduce" and c.nbytes > 4]
    assert sum(c.nbytes for c in buckets) == grad_bytes
    assert len(buckets) == -(-grad_bytes // (2**18))


@pytest.mark.slow
def test_probe_together_times_each_layout_in_several_processes():
    """Two processes probe the same layouts at once (as a machine's two ranks run); each
    layout comes back with the collectives the in-process probe records."""
    jobs = [planned_run(tiny_config(zero_stage=3), 2), planned_run(tiny_config(), 1)]
    together = probe_together(jobs, 2, repeats=1)
    for run, found in zip(jobs, together, strict=True):
        alone = probe(run, repeats=1)
        assert found.collectives == alone.collectives
        assert found.compute_s > 0


@pytest.mark.slow
def test_calibration_stores_collective_costs(tmp_path, monkeypatch):
    """Two real gloo processes time each collective; the stored fit prices later plans."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    found = calibrate(repeats=3)
    costs = collective_costs(load_calibration())
    assert set(costs) == set(KINDS)
    for kind, cost in costs.items():
        assert cost.group_size == 2
        assert cost.latency_s + cost.s_per_byte > 0, kind
        assert cost.as_dict() == found["collectives"][kind]
    # A message costs more than an empty one of the same kind.
    assert costs["all_reduce"].seconds(2**24, 2) > costs["all_reduce"].seconds(0, 2)
    # Two single-threaded ranks on this machine's cores: a share, stored, that plans use.
    assert 0.0 <= found["concurrency"] <= 1.0
    assert cluster_of(parse([])).concurrency == found["concurrency"]
    assert cluster_of(parse(["--peak", "989T"])).concurrency == 1.0


def pipeline_config(schedule: str) -> Config:
    cfg = tiny_config(pp=2, pp_schedule=schedule)
    # 8 microbatches of 2 sequences: 1F1B keeps 2 (stage 0) and 1, GPipe 8; sequences long
    # enough that activations, not the gradients made during backward, set the peak.
    t = cfg.training
    t.seq_len, t.micro_batch_size, t.global_batch_size = 128, 2, 16
    return cfg


def _pipeline_worker(rank: int, tmp_path: Path) -> None:
    """Each pp rank's memory over a real schedule step (gloo, 2 processes), counted like the
    planner counts fake tensors: the second step (the first allocates the receive buffers)."""
    with process_group(rank, 2, store_file=tmp_path / "store"):
        found = {}
        for schedule in SCHEDULES:
            cfg = pipeline_config(schedule)
            tokens = torch.zeros(2, cfg.training.seq_len, dtype=torch.long)
            found[schedule] = real_step_memory(cfg, [(tokens, tokens)] * 8)
        (tmp_path / f"rank{rank}.json").write_text(json.dumps(found))


SCHEDULES = ("1f1b", "gpipe")


@pytest.mark.slow
def test_pipeline_memory_predicted_matches_a_real_schedule(tmp_path):
    """pp2 on 2 real ranks: each rank's model states within 5% and its activations (the
    schedule's in-flight microbatches) within 10% of the plan from fake stage steps."""
    mp.spawn(_pipeline_worker, args=(tmp_path,), nprocs=2)
    for rank in (0, 1):
        measured = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for schedule in SCHEDULES:
            planned = estimate_pipeline_memory(planned_run(pipeline_config(schedule), 2), rank=rank)
            got = measured[schedule]
            for kind in ("params", "grads", "optimizer"):
                assert getattr(planned, kind) == pytest.approx(got[kind], rel=0.05), (
                    rank,
                    schedule,
                    kind,
                )
            assert planned.activations == pytest.approx(got["activations"], rel=0.10), (
                rank,
                schedule,
                planned,
                got,
            )
    # GPipe keeps all 8 microbatches where 1F1B keeps 2 (stage 0): the schedules must differ.
    first = json.loads((tmp_path / "rank0.json").read_text())
    assert first["gpipe"]["activations"] > 2 * first["1f1b"]["activations"]


def test_in_flight_microbatches_per_schedule():
    assert [in_flight("1f1b", 4, r, 1, 8) for r in range(4)] == [4, 3, 2, 1]
    assert in_flight("1f1b", 4, 0, 1, 2) == 2
    assert in_flight("gpipe", 4, 3, 1, 8) == 8
    # Interleaved, 2 stages per rank on 4 ranks: (v - 1) p + 2 (p - 1 - r) + 1.
    assert [in_flight("interleaved_1f1b", 4, r, 2, 8) for r in range(4)] == [11, 9, 7, 5]
    assert in_flight("interleaved_1f1b", 4, 0, 2, 4) == 8


def test_search_plans_pipeline_layouts_at_their_worst_rank():
    cfg = pipeline_config("1f1b")
    cluster = Cluster(
        nodes=1,
        gpus_per_node=2,
        memory_bytes=1e9,
        peak_flops=1e12,
        efficiency=1.0,
        intra_bw=1e9,
        inter_bw=1e9,
    )
    found = layouts_of(cfg, cluster, stages=(0,), checkpointing=("none",))
    assert {c.pp for c in found} == {1, 2}
    run = planned_run(cfg, 2)
    ranks = [estimate_pipeline_memory(run, rank=r) for r in (0, 1)]
    row = memory_row(run, {})
    assert row["peak"] == max(m.peak for m in ranks)
    assert row["peak"] > row["params"] + row["grads"] + row["optimizer"]
