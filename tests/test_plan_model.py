"""The planner's memory model against full fake builds of the same layouts, and its
communication advice against the byte formulas it states (in this process, on torch's fake
process group)."""

import dataclasses

import pytest

from distrain.config.schema import Config
from distrain.errors import ConfigError
from distrain.family.spec import FamilyModel
from distrain.models.gpt.flavors import PRESETS
from distrain.models.gpt.spec import GPT_SPEC
from distrain.plan.built_rows import built_row, memory_of, memory_row
from distrain.plan.comm_advice import advise, predict_methods
from distrain.plan.command import cluster_of, link_bandwidth, parse
from distrain.plan.memory_model import calibrate_family, calibration_builds, modelled_row
from distrain.plan.search import candidate_plan
from distrain.plan.timing import Candidate, Cluster, step_time

WORLD = 4


def base_config() -> Config:
    cfg = Config()
    cfg.run.device = "cpu"
    cfg.model.preset = "tiny"
    cfg.model.n_layers = 6
    cfg.training.seq_len, cfg.training.global_batch_size = 64, 16
    cfg.training.compile = False
    return cfg


# (dp_shard, tp, pp, zero stage, checkpointing, micro-batch) on 4 ranks.
LAYOUTS = [
    (4, 1, 1, 0, "full", 4),
    (4, 1, 1, 1, "none", 4),
    (4, 1, 1, 2, "full", 4),
    (4, 1, 1, 3, "none", 1),
    (2, 2, 1, 0, "none", 2),
    (2, 2, 1, 1, "none", 2),
    (2, 2, 1, 3, "none", 2),
    (2, 1, 2, 1, "none", 2),
    (2, 1, 2, 3, "none", 2),
    (1, 1, 4, 0, "none", 1),
]


def calibrated(base: Config, cache: dict):
    """The `coefficients` argument of modelled_row: each family calibrated once, from builds
    kept in `cache`; with the dict of the families it calibrated."""
    coefficients = {}

    def coefficients_of(family):
        if family not in coefficients:
            builds = calibration_builds(base, family)
            coefficients[family] = calibrate_family(family, builds, lambda b: memory_of(b, cache))
        return coefficients[family]

    return coefficients_of, coefficients


@pytest.fixture(scope="module")
def modelled_and_built():
    base, cache = base_config(), {}
    coefficients_of, _ = calibrated(base, cache)

    rows = []
    for shard, tp, pp, stage, ac, mb in LAYOUTS:
        c = Candidate(1, shard, tp, pp, stage, ac, mb)
        run = candidate_plan(base, c, WORLD)
        cfg = run.config
        rows.append(
            (
                c,
                modelled_row(
                    WORLD,
                    coefficients_of,
                    model=cfg.model,
                    parallel=cfg.parallel,
                    training=cfg.training,
                    optim=cfg.optim,
                ),
                memory_row(run, cache),
            )
        )
    return rows


def test_model_states_equal_the_fake_builds(modelled_and_built):
    """Parameters, gradients and optimizer state by arithmetic: equal to the full builds'
    (within 6%: the norms each tp rank holds whole, counted once by the build's gradients)."""
    for c, modelled, built in modelled_and_built:
        for kind in ("params", "grads", "optimizer"):
            assert modelled[kind] == pytest.approx(built[kind], rel=0.06), (c, kind)
        assert modelled["params"] == built["params"], c


def test_peak_within_ten_percent_of_the_fake_builds(modelled_and_built):
    """The peak per rank of 10 layouts (DDP, ZeRO-1/2/3, tp 2, pp 2 and 4, with and without
    checkpointing, micro-batch 1-4) from two shallow builds per family: within 10% of the full
    6-block builds."""
    for c, modelled, built in modelled_and_built:
        assert modelled["peak"] == pytest.approx(built["peak"], rel=0.10), c


# (dp_shard, tp, pp, zero stage, checkpointing, micro-batch) of another family on 4 ranks.
QWEN3_LAYOUTS = [(4, 1, 1, 2, "full", 4), (2, 2, 1, 0, "none", 2), (2, 1, 2, 3, "none", 2)]


def modelled_and_built_peaks(
    base: Config, layouts, *, candidates=(), rows: bool = False
) -> list[tuple[tuple, int, int]]:
    """(layout, modelled peak, full fake build's peak) of each of `layouts` (without data
    parallel replicas) and `candidates` on WORLD ranks; `rows`: the whole rows, not peaks."""
    cache = {}
    coefficients_of, _ = calibrated(base, cache)
    found = []
    for layout in [Candidate(1, *layout) for layout in layouts] + list(candidates):
        run = candidate_plan(base, layout, WORLD)
        cfg = run.config
        modelled = modelled_row(
            WORLD,
            coefficients_of,
            model=cfg.model,
            parallel=cfg.parallel,
            training=cfg.training,
            optim=cfg.optim,
        )
        built = memory_row(run, cache, exhaustive=True)
        found.append(
            (layout, modelled, built) if rows else (layout, modelled["peak"], built["peak"])
        )
    return found


def test_another_family_within_five_percent_of_the_fake_builds():
    """qwen3's tiny preset (grouped-query attention, q/k norms, SwiGLU), 6 blocks: ZeRO-2 with
    checkpointing, tp 2 and pp 2 x FSDP priced by the memory model within 5% of the full fake
    builds (benchmarks/plan_error.py measured 0.0%, 0.0% and -1.5% on these layouts)."""
    base = base_config()
    base.model.family, base.model.preset = "qwen3", "qwen3-tiny"
    for layout, modelled, built in modelled_and_built_peaks(base, QWEN3_LAYOUTS):
        assert modelled == pytest.approx(built, rel=0.05), layout


def test_zero3_checkpointed_and_mixtral_within_five_percent_of_the_fake_builds():
    """ZeRO-3 with full checkpointing, whose peak moves between 2 and 3 blocks (calibrated at 3
    and 4: a line through 2 and 3 was 25% over on `tiny`), and mixtral's tiny preset, whose
    router now builds on fake tensors (its counts had a data-dependent shape): within 5%."""
    base = base_config()
    zero3_full = (4, 1, 1, 3, "full", 2)
    for layout, modelled, built in modelled_and_built_peaks(base, [zero3_full]):
        assert modelled == pytest.approx(built, rel=0.05), layout
    base.model.family, base.model.preset = "mixtral", "mixtral-tiny"
    for layout, modelled, built in modelled_and_built_peaks(base, [zero3_full]):
        assert modelled == pytest.approx(built, rel=0.05), ("mixtral", layout)


def test_a_peak_whose_moment_changes_with_depth_is_priced_at_the_full_depth():
    """`tiny` with a 16k vocabulary at seq 128 under ZeRO-2: at 2 and 3 blocks the step peaks
    while FSDP2's gathered embedding and head and their gradients are live (32 MiB, whatever
    the micro-batch); deeper, the blocks' activations pass it. With the steepest moment on its
    own line through the two depths, the memory model and the verified row price 16 blocks
    within 1% of the full build; the line through the two shallow peaks alone is more than 10%
    under (it was the model: llama3-8b with cp 2 priced 7.8 GiB above the states where 31 GB
    are)."""
    base = base_config()
    base.model.vocab_size, base.model.n_layers, base.training.seq_len = 16384, 16, 128
    cache = {}
    coefficients_of, coefficients = calibrated(base, cache)

    run = candidate_plan(base, Candidate(1, 4, 1, 1, 2, "none", 1), WORLD)
    cfg = run.config
    modelled = modelled_row(
        WORLD,
        coefficients_of,
        model=cfg.model,
        parallel=cfg.parallel,
        training=cfg.training,
        optim=cfg.optim,
    )
    verified = built_row(run, cache)
    full = memory_row(run, cache, exhaustive=True)
    assert modelled["peak"] == pytest.approx(full["peak"], rel=0.01)
    assert verified["peak"] == pytest.approx(full["peak"], rel=0.01)
    (c,) = coefficients.values()
    (low, high), states = c.depths, c.states
    shallow = [m.fwd_bwd(1, accumulating=True) - s for m, s in zip(c.builds, states, strict=True)]
    through_peaks = shallow[0] + (shallow[1] - shallow[0]) * (16 - low) / (high - low)
    held = full["params"] + full["grads"] + full["optimizer"]
    assert held + through_peaks < 0.9 * full["peak"]


def test_diloco_sites_are_planned_with_their_outer_state():
    """DiLoCo over 2 sites of FSDP 2 (the search's HSDP layouts under diloco.inner_steps):
    calibrated on sites of its own, the memory model prices the outer optimizer (fp32 global
    weights and momentum: two more copies of the rank's parameters than the same layout
    without DiLoCo) and the peak within 5% of the full fake build, ZeRO-2 and ZeRO-3 with
    checkpointing, first and later micro-batches."""
    base = base_config()
    base.parallel.zero_stage = 2
    without = modelled_and_built_peaks(
        base, [], candidates=[Candidate(2, 2, 1, 1, 2, "none", 2)], rows=True
    )
    base.diloco.inner_steps = 4
    layouts = [Candidate(2, 2, 1, 1, 2, "none", 2), Candidate(2, 2, 1, 1, 3, "full", 4)]
    rows = modelled_and_built_peaks(base, [], candidates=layouts, rows=True)
    for layout, modelled, built in rows:
        assert modelled["peak"] == pytest.approx(built["peak"], rel=0.05), layout
    (_, plain, _), (_, outer, _) = without[0], rows[0]
    assert outer["optimizer"] - plain["optimizer"] == pytest.approx(2 * plain["params"], rel=0.01)


def test_an_uncalibrated_model_would_miss():
    """The bound can fail: without the cost of the blocks (both calibration depths read as the
    shallower: a model that counts only the model states and the constant) the peak of a large
    micro-batch is far off."""
    base, cache = base_config(), {}
    c = Candidate(1, 4, 1, 1, 0, "none", 4)
    run = candidate_plan(base, c, WORLD)
    cfg = run.config

    def no_blocks(family):
        import dataclasses

        builds = calibration_builds(base, family)
        got = calibrate_family(family, builds, lambda b: memory_of(b, cache))
        shallow, _ = got.builds
        return dataclasses.replace(got, builds=(shallow, shallow), states=(got.states[0],) * 2)

    built = memory_row(run, cache)
    assert (
        modelled_row(
            WORLD,
            no_blocks,
            model=cfg.model,
            parallel=cfg.parallel,
            training=cfg.training,
            optim=cfg.optim,
        )["peak"]
        < 0.9 * built["peak"]
    )


def two_hosts(bits_per_s: float) -> Cluster:
    """The 2-host lab: one rank per host, a CPU's rate."""
    return Cluster(
        nodes=2,
        gpus_per_node=1,
        memory_bytes=16e9,
        peak_flops=100e9,
        efficiency=1.0,
        intra_bw=10e9,
        inter_bw=bits_per_s / 8,
    )


def small_advice(bits_per_s: float):
    model = FamilyModel(GPT_SPEC, PRESETS["small"])
    c = Candidate(2, 1, 1, 1, 0, "none", 8)
    return advise(c, model, two_hosts(bits_per_s), global_batch=32, seq_len=128, bytes_per_value=4)


def test_advice_is_diloco_at_100_mbit_and_plain_ddp_at_400_gbit():
    slow = small_advice(100e6)
    assert slow.recommended.method == "diloco" and slow.recommended.inner_steps >= 2
    plain = next(m for m in slow.methods if m.method == "plain")
    chosen = slow.recommended
    assert chosen.exposed_comm_s <= 0.1 * (chosen.step_s - chosen.exposed_comm_s)
    assert plain.exposed_comm_s > chosen.step_s
    fast = small_advice(400e9)
    assert fast.recommended.method == "plain"
    assert fast.recommended.exposed_comm_s == 0.0
    assert "DiLoCo H=" in slow.summary() and "plain:" in slow.summary()


def test_bytes_per_step_follow_the_ring_formulas():
    """DDP: 2 (n - 1) / n x 4 bytes a gradient value; DiLoCo: the same all-reduce of the
    pseudo-gradient in its sync dtype once per H steps; bf16: half of DDP's."""
    args = FamilyModel(GPT_SPEC, PRESETS["small"])
    psi = args.num_params()
    for n in (2, 4):
        methods = {
            m.method: m for m in predict_methods(args, compute_s=1.0, replicas=n, bandwidth=12.5e6)
        }
        ddp = 2 * (n - 1) / n * 4 * psi
        assert methods["plain"].bytes_per_step == pytest.approx(ddp)
        assert methods["bf16"].bytes_per_step == pytest.approx(ddp / 2)
        h = methods["diloco"].inner_steps
        assert methods["diloco"].bytes_per_step == pytest.approx(ddp / h)
        bf16 = predict_methods(args, compute_s=1.0, replicas=n, bandwidth=12.5e6, sync_dtype="bf16")
        diloco = next(m for m in bf16 if m.method == "diloco")
        assert diloco.bytes_per_step == pytest.approx(ddp / 2 / diloco.inner_steps)


def test_concurrency_scales_what_backward_hides():
    """Gradient communication hides behind the backward's 2/3 of the compute times the ranks'
    concurrency: all of it at 1 (a GPU), none at 0 (a collective that waits for the core), in
    the layout's step time and in every overlapped method's prediction alike."""
    model = FamilyModel(GPT_SPEC, PRESETS["small"])
    c = Candidate(2, 1, 1, 1, 0, "none", 8)
    kw = dict(global_batch=32, seq_len=128, bytes_per_value=4)
    for concurrency in (1.0, 0.25, 0.0):
        cluster = dataclasses.replace(two_hosts(100e6), concurrency=concurrency)
        t = step_time(c, model, cluster, **kw)
        assert t.dp_comm_s > t.compute_s  # more than the backward can hide, at any concurrency
        assert t.exposed_comm_s == pytest.approx(t.dp_comm_s - 2 / 3 * concurrency * t.compute_s)
        methods = {m.method: m for m in advise(c, model, cluster, **kw).methods}
        # The same step, but for the advice's per-message latency (0.4 ms here).
        assert methods["plain"].step_s == pytest.approx(t.step_s, abs=1e-3)
        for name in ("plain", "bf16", "powersgd"):
            m = methods[name]
            hidden = min(m.comm_s, 2 / 3 * concurrency * t.compute_s)
            assert m.exposed_comm_s == pytest.approx(m.comm_s - hidden), name
        # 1-bit Adam's exchange is in its optimizer step: never hidden.
        assert methods["onebit_adam"].exposed_comm_s == methods["onebit_adam"].comm_s


def test_inter_node_bandwidth_is_read_in_bits_per_node():
    assert link_bandwidth("100Mbit", "x") == pytest.approx(12.5e6)
    assert link_bandwidth("400Gbit/s", "x") == pytest.approx(50e9)
    assert link_bandwidth("50GB/s", "x") == pytest.approx(50e9)
    cluster = cluster_of(parse(["--gpus-per-node", "8", "--inter-node-bandwidth", "1Gbit"]))
    assert cluster.inter_bw == pytest.approx(1e9 / 8 / 8)


def test_the_command_restates_the_planner_defaults():
    from distrain.plan import comm_advice, command, search

    assert command.VERIFIED == search.VERIFIED
    assert command.DEFAULT_LATENCY_S == comm_advice.DEFAULT_LATENCY_S


def test_plan_notes_the_files_it_does_not_read_and_plans_without_them(tmp_path):
    """A config naming a tokenizer and a Hugging Face folder that are not there (the data file
    is never read by a plan): both are noted, the plan's config goes on with model.preset's
    shape and no tokenizer check, and it is a valid layout to plan."""
    from distrain.layout.rules import validate
    from distrain.plan.command import base_config

    toml = tmp_path / "absent.toml"
    toml.write_text(
        f'[model]\nfamily = "llama"\npreset = "llama-tiny"\n'
        f'init_from = "hf:{tmp_path / "no-model"}"\n'
        f'[data]\npath = "{tmp_path / "none.bin"}"\ntokenizer = "hf:{tmp_path / "no-tok"}"\n'
    )
    absent: list[str] = []
    cfg = base_config(parse(["--config", str(toml), "--gpus-per-node", "2"]), absent)
    assert len(absent) == 2, absent
    assert "model.init_from: no config.json in" in absent[0] and "data.tokenizer" in absent[1]
    kept = (cfg.model.preset, cfg.model.init_from, cfg.data.tokenizer)
    assert kept == ("llama-tiny", "", "bytes")
    assert validate(cfg, 2).shape.n_layers == 2


def test_gpu_memory_must_say_its_unit():
    cluster = cluster_of(parse(["--gpu-memory", "80GiB"]))
    assert cluster.memory_bytes == 80 * 2**30
    assert cluster_of(parse(["--gpu-memory", "80GB"])).memory_bytes == 80e9
    with pytest.raises(ConfigError, match=r"--gpu-memory: '80' has no unit; write it in GB"):
        cluster_of(parse(["--gpu-memory", "80"]))
