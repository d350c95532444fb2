"""Gradient communication end to end (2-4 ranks through `distrain train`): compression hooks
make (nearly) the uncompressed run's loss progress and report their bytes; 1-bit Adam equals
Adam during warm-up and then sends ~32x fewer bytes; hierarchical all-reduce across two
torchrun agents ("nodes") equals the flat all-reduce. Unit-level checks of the hooks are in
test_compress.py. The 2-rank runs share a torchrun launch with the session's other 2-rank runs
(tests/batch.py's pool)."""

import copy
from pathlib import Path

import pytest
import torch
from batch import Run, pool_name
from helpers import cli_in_process, free_port, losses, overrides, process_group, start_train

from distrain.config.io import load_config
from distrain.models.decoder.counts import num_params
from distrain.models.registry import model_args
from distrain.observe.metrics import read_metrics
from distrain.optim.onebit_adam import OneBitAdam
from distrain.optim.param_groups import param_groups
from distrain.optim.state_dict import load_optimizer_state_dict, optimizer_state_dict

# Long enough for the lossy methods' lag to show: at 12 steps 1-bit had made 0.93-0.96 of the
# uncompressed run's progress, at 30-40 steps it settles (see HOOKS).
STEPS = 30
# Training losses of one step are noisy (+-0.3 between batches), so progress is measured to the
# mean of the last WINDOW steps; every run sees the same batches, so the noise is shared.
WINDOW = 8
FIELDS = {
    "training__steps": STEPS,
    "training__global_batch_size": 8,
    "training__micro_batch_size": 4,
    "training__seq_len": 64,
    "optim__warmup_steps": 2,
    "checkpoint__interval_steps": 0,
    "checkpoint__at_end": False,
}


def _rows(run) -> list[dict]:
    return [r for r in read_metrics(run / "metrics.jsonl") if "loss" in r]


def _progress(rows: list[dict], reference: list[dict], *, same_start: bool = True) -> float:
    """The share of the reference run's loss decrease (first step to the mean of the last
    WINDOW steps) that `rows` made. `same_start`: the first losses (before any update) are
    equal; a caller that passes False has checked them within its own tolerance."""

    def decrease(r: list[dict]) -> float:
        return r[0]["loss"] - sum(row["loss"] for row in r[-WINDOW:]) / WINDOW

    assert rows[0]["loss"] == reference[0]["loss"] or not same_start
    return decrease(rows) / decrease(reference)


UNCOMPRESSED = "uncompressed"
# Layouts whose own collectives (no gradient hook) make their comm_bytes.
LAYOUT_TEST = "test_a_layouts_own_collectives_are_counted"
LAYOUT_COMM = {"zero3": {"parallel__zero_stage": 3}, "pp2": {"parallel__pp": 2}}


def batched_runs(names: set[str]) -> dict[str, Run]:
    """This module's 2-rank runs that the selected test cases `names` need (tests/batch.py's
    pool): one per case, named after it (`case:role` for the flat run that the hierarchical one
    is compared with), and UNCOMPRESSED."""
    runs = {
        f"test_compression_hook_makes_the_uncompressed_progress[{kind}]": Run(
            2, dict(FIELDS, comm__gradient_compression=kind, comm__powersgd_start_step=2)
        )
        for kind, _, _ in HOOKS
    }
    for name, (zero_stage, _, _) in zip(ONEBIT_IDS, ONEBIT_STAGES, strict=True):
        runs[f"test_onebit_adam_is_adam_then_sends_16x_less[{name}]"] = Run(
            2,
            dict(
                FIELDS,
                optim__name="onebit_adam",
                optim__onebit__freeze_step=ONEBIT_FREEZE,
                parallel__zero_stage=zero_stage,
            ),
        )
    for kind, _, _ in CP_HOOKS:
        runs[f"{CP_HOOK}[{kind}]"] = Run(
            2,
            dict(
                FIELDS, parallel__cp=2, comm__gradient_compression=kind, comm__powersgd_start_step=2
            ),
        )
    cp_adam = dict(FIELDS, training__steps=CP_ONEBIT_STEPS, parallel__cp=2)
    for name, (zero_stage, _, _) in zip(ONEBIT_IDS, ONEBIT_STAGES, strict=True):
        runs[f"{CP_ONEBIT}[{name}]"] = Run(
            2,
            dict(
                cp_adam,
                optim__name="onebit_adam",
                optim__onebit__freeze_step=ONEBIT_FREEZE,
                parallel__zero_stage=zero_stage,
            ),
        )
    for name, (fields, _, _) in ONEBIT_LAYOUTS.items():
        runs[f"test_onebit_adam_under_tp_and_pp_is_adam_then_sends_16x_less[{name}]"] = Run(
            4,
            dict(
                FIELDS,
                optim__name="onebit_adam",
                optim__onebit__freeze_step=ONEBIT_FREEZE,
                debug__check_replicas=True,
                **fields,
            ),
        )
    runs[f"{HIERARCHICAL}:flat"] = Run(4, HIERARCHICAL_FIELDS)
    for name, fields in LAYOUT_COMM.items():
        runs[f"{LAYOUT_TEST}[{name}]"] = Run(2, dict(FIELDS, training__steps=4, **fields))
    runs = {name: run for name, run in runs.items() if name.split(":")[0] in names}
    others = any(not name.startswith(CP_ONEBIT) for name in runs)
    if any(name.startswith(CP_ONEBIT) for name in runs):  # AdamW under their own layout
        runs[CP_ADAM] = Run(2, cp_adam)
    # Every other test of these runs compares with the uncompressed one, as the plain count does.
    if others or "test_plain_allreduce_is_counted_without_a_hook" in names:
        runs[UNCOMPRESSED] = Run(2, FIELDS)
    return runs


@pytest.fixture(scope="module")
def batched(batch_pool):
    """The run dir of a run of `batched_runs`, once it trained without error."""

    def run_dir(name: str) -> Path:
        return batch_pool.trained(pool_name(__name__, name))

    return run_dir


@pytest.fixture(scope="module")
def uncompressed(batched):
    return _rows(batched(UNCOMPRESSED))


# (kind, least share of the uncompressed run's loss progress, least bytes ratio). Measured at 30
# steps: fp16 and bf16 1.00, PowerSGD 0.99, 1-bit 0.905: its averaged chunks are compressed a second
# time (as in 1-bit Adam, so that its bytes do not grow with N), which costs some progress on this
# task in 30 steps (tests/test_compress.py: 0.96 at the plateau). A hook that drops gradients makes
# 0 (tests/test_compress.py checks that the bound rejects it).
HOOKS = [
    ("fp16", 0.99, 2.0),
    ("bf16", 0.99, 2.0),
    ("powersgd", 0.9, 1.5),
    ("onebit", 0.85, 30.0),
]


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "least_progress", "ratio"), HOOKS, ids=[h[0] for h in HOOKS])
def test_compression_hook_makes_the_uncompressed_progress(
    kind, least_progress, ratio, uncompressed, batched, request
):
    rows = _rows(batched(request.node.name))
    assert _progress(rows, uncompressed) >= least_progress, kind
    assert rows[-1]["comm_compression_ratio"] >= ratio
    assert uncompressed[-1]["comm_compression_ratio"] == 1.0
    assert all(r["comm_bytes"] > 0 and r["comm_inflight_s"] > 0 for r in rows)


@pytest.mark.slow
def test_plain_allreduce_is_counted_without_a_hook(uncompressed, tmp_path):
    cfg = load_config(None, overrides(tmp_path, **FIELDS))
    params = num_params(model_args(cfg.model))
    # Every step all-reduces every fp32 gradient once (DDP's built-in path, no Python hook): the
    # bytes are the parameters', and nothing times it.
    assert [r["comm_bytes"] for r in uncompressed] == [4.0 * params] * STEPS
    assert all(r["comm_compression_ratio"] == 1.0 for r in uncompressed)
    assert not any("comm_inflight_s" in r for r in uncompressed)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUT_COMM))
def test_a_layouts_own_collectives_are_counted(name, batched, request, tmp_path):
    """comm_bytes of layouts that communicate without a gradient hook (recorded over one step,
    parallel/comm_record.py), against their count by hand on 2 ranks: ZeRO-3 all-gathers the
    fp32 parameters in forward and again in backward and reduce-scatters the gradients, each
    rank sending (N - 1)/N of them each time (accumulation 1: 3 x 2P bytes); rank 0 of a 2-stage
    pipeline sends the global batch's activations to stage 1 ([8, 64, 128] fp32). Each also
    sends a few bytes for scalars (the gradient norm's all-reduce: 4; measured 4 and 6 in all).
    The count is there from the second step, the one recorded (the first also sets the
    pipeline's shapes up)."""
    rows = _rows(batched(request.node.name))
    assert "comm_bytes" not in rows[0]
    rows = rows[1:]
    fields = dict(FIELDS, **LAYOUT_COMM[name])
    cfg = load_config(None, overrides(tmp_path, **fields))
    args = model_args(cfg.model)
    t = cfg.training
    want = {
        "zero3": 3 * 4.0 * num_params(args) / 2,
        "pp2": 4.0 * t.global_batch_size * t.seq_len * args.dim,
    }[name]
    counted = {r["comm_bytes"] for r in rows}
    assert len(counted) == 1 and want + 4 <= counted.pop() <= want + 16, (counted, want)


# zero_stage 1: OneBitZeroAdam (state sharded, gradients compressed to the owners, the owners'
# momenta compressed back, 4 bytes of scale per block of <= 2048 values each way): measured
# 0.928 of Adam's progress and 31.40x fewer bytes.
ONEBIT_STAGES = [(0, 0.8, 31.9), (1, 0.9, 31.3), (2, 0.9, 31.3)]
ONEBIT_IDS = ["ddp", "zero1", "zero2"]
ONEBIT_FREEZE = 5


@pytest.mark.slow
@pytest.mark.parametrize(("zero_stage", "least_progress", "ratio"), ONEBIT_STAGES, ids=ONEBIT_IDS)
def test_onebit_adam_is_adam_then_sends_16x_less(
    zero_stage, least_progress, ratio, uncompressed, batched, request
):
    rows = _rows(batched(request.node.name))
    _check_onebit(rows, uncompressed, least_progress, ratio, first_compressed=zero_stage >= 1)


def _check_onebit(
    rows: list[dict], adam: list[dict], least_progress: float, ratio: float, *, first_compressed
) -> None:
    """`rows` of a 1-bit Adam run against AdamW's: the same losses in warm-up, `ratio` x fewer
    bytes past it (the first compressed step left out where `first_compressed` gathers the
    frozen variance), `least_progress` of its loss decrease."""
    freeze = ONEBIT_FREEZE
    # Warm-up: the same AdamW math on the same all-reduced gradients; per-parameter vs foreach
    # kernels round differently (~1e-7), hence 1e-6. Loss at step k+1 reflects k updates.
    for got, want in zip(rows[: freeze + 1], adam[: freeze + 1], strict=True):
        assert abs(got["loss"] - want["loss"]) <= 1e-6 * want["loss"], (got, want)
    # Past the freeze step only the 1-bit momentum exchange is on the wire: 32x fewer bytes sent
    # than a ring fp32 all-reduce, less the scales (measured 31.998). Under ZeRO-1/2 the first
    # compressed step also all-gathers the frozen variance (fp32, once).
    for row in rows[freeze + 1 + first_compressed :]:
        assert row["comm_compression_ratio"] >= ratio, row
    # A freeze step of 5 is far shorter than a real warm-up: the frozen variance and the
    # compressed momentum then make less progress than Adam (measured 0.86 at 30 steps).
    # (The first loss is within 1e-6 above: pp sums the same batch in other micro-batches.)
    assert _progress(rows, adam, same_start=False) >= least_progress


# 1-bit Adam under tp and pp (zero_stage 0; 4 ranks, dp 2): no wrapper, the optimizer averages
# the warm-up's fp32 gradients itself and compresses each unit of values held alike (replicated
# over tp; an embedding tied across the first and last stage) on its own. debug.check_replicas
# proves after every step that the dp replicas, the tp-replicated parameters and the tied
# copies stay equal (compressing one flat vector per rank instead, the tp ranks' norm weights
# differed after the first compressed step: measured). pp needs two pipeline microbatches,
# hence micro-batches of 2: the same batch in other float sums (warm-up within 2e-7). (fields,
# least progress, least bytes ratio); measured 0.80 and 32.0x (tp2, sequence parallel; 0.81
# without), 0.88 and 32.0x (pp2): the short freeze's loss spikes after it fall differently per
# layout (plain 1-bit Adam on 2 ranks: 0.86).
ONEBIT_LAYOUTS = {
    "tp2_dp2": ({"parallel__tp": 2}, 0.75, 31.9),
    "pp2_dp2": ({"parallel__pp": 2, "training__micro_batch_size": 2}, 0.8, 31.9),
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(ONEBIT_LAYOUTS))
def test_onebit_adam_under_tp_and_pp_is_adam_then_sends_16x_less(
    layout, uncompressed, batched, request
):
    _, least_progress, ratio = ONEBIT_LAYOUTS[layout]
    rows = _rows(batched(request.node.name))
    _check_onebit(rows, uncompressed, least_progress, ratio, first_compressed=False)


# Context parallelism (cp2 on 2 ranks, dp 1): DDP averages over dp x cp, so the hooks and
# 1-bit Adam's momentum exchange run over the cp ranks. Every hook gets that group from one call
# (data.install_comm_hook); the 1-bit hook, with error feedback and chunks sized by the group,
# meets its criteria of HOOKS against the same uncompressed dp2 run (measured 0.926 of its
# progress, 31.4x fewer bytes; once each, not rerun in CI: fp16 1.000, bf16 1.000, PowerSGD
# 0.988). cp2's first loss equals dp2's exactly here, as _progress asserts.
CP_HOOK = "test_compression_hook_over_dp_x_cp_makes_the_uncompressed_progress"
CP_HOOKS = [hook for hook in HOOKS if hook[0] == "onebit"]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("kind", "least_progress", "ratio"), CP_HOOKS, ids=[h[0] for h in CP_HOOKS]
)
def test_compression_hook_over_dp_x_cp_makes_the_uncompressed_progress(
    kind, least_progress, ratio, uncompressed, batched, request
):
    test_compression_hook_makes_the_uncompressed_progress(
        kind, least_progress, ratio, uncompressed, batched, request
    )


CP_ONEBIT = "test_onebit_adam_over_dp_x_cp_is_adam_then_sends_16x_less"
# Warm-up and two compressed steps (three under ZeRO-1/2, whose first one also all-gathers the
# frozen variance): the exchange, not the progress, is what cp changes. Compared with AdamW
# under the same cp2 layout and schedule (CP_ADAM).
CP_ONEBIT_STEPS = ONEBIT_FREEZE + 3
CP_ADAM = "cp_adam"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("zero_stage", "ratio"), [(s[0], s[2]) for s in ONEBIT_STAGES], ids=ONEBIT_IDS
)
def test_onebit_adam_over_dp_x_cp_is_adam_then_sends_16x_less(zero_stage, ratio, batched, request):
    rows, adam = _rows(batched(request.node.name)), _rows(batched(CP_ADAM))
    assert len(rows) == len(adam) == CP_ONEBIT_STEPS
    # Warm-up: AdamW's math on the gradients averaged over the cp ranks (per-parameter vs
    # fused kernels round differently: measured 1.1e-7 relative, the 1e-6 of the dp2 test).
    for got, want in zip(rows[: ONEBIT_FREEZE + 1], adam[: ONEBIT_FREEZE + 1], strict=True):
        assert abs(got["loss"] - want["loss"]) <= 1e-6 * want["loss"], (got, want)
    # Past the freeze: the 1-bit momentum exchange alone, over both cp ranks (measured 32.00x
    # plain, 31.40x under ZeRO-1/2, as over dp2).
    for row in rows[ONEBIT_FREEZE + 1 + (zero_stage >= 1) :]:
        assert row["comm_compression_ratio"] >= ratio, row


HIERARCHICAL = "test_hierarchical_all_reduce_across_two_agents_equals_flat"
# Equality: 12 steps do.
HIERARCHICAL_FIELDS = dict(FIELDS, training__micro_batch_size=2, training__steps=12)


@pytest.mark.slow
def test_hierarchical_all_reduce_across_two_agents_equals_flat(tmp_path, batched):
    fields = HIERARCHICAL_FIELDS
    flat = batched(f"{HIERARCHICAL}:flat")
    run = tmp_path / "hier"
    endpoint = f"127.0.0.1:{free_port()}"
    agents = [
        start_train(
            run,
            *("--nnodes", "2", "--nproc", "2", "--node-rank", str(node)),
            *("--rdzv-endpoint", endpoint, "--rdzv-id", "hier"),
            **fields,
            comm__hierarchical=True,
        )
        for node in (0, 1)
    ]
    for agent in agents:
        _, stderr = agent.communicate(timeout=180)
        assert agent.returncode == 0, stderr[-3000:]
    want = losses(read_metrics(flat / "metrics.jsonl"))
    got = losses(read_metrics(run / "metrics.jsonl"))
    # 1e-6: reduce-then-all-reduce adds the four ranks' fp32 gradients in another order.
    assert got.keys() == want.keys()
    for step in want:
        assert abs(got[step] - want[step]) <= 1e-6 * want[step], (step, got[step], want[step])


def test_onebit_adam_refuses_sharded_data_parallel(tmp_path, capsys):
    args = ["train", "--nproc", "2"]
    for key, value in overrides(
        tmp_path / "run", **FIELDS, optim__name="onebit_adam", parallel__zero_stage=3
    ):
        args += [f"--{key}", value]
    result = cli_in_process(capsys, *args)
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("distrain: error:")]
    assert errors and "does not compose with parallel.zero_stage = 3 (FSDP2" in errors[0]


def _onebit(model: torch.nn.Module) -> OneBitAdam:
    return OneBitAdam(
        param_groups(model, 0.1), lr=1e-2, betas=(0.9, 0.99), eps=1e-8, freeze_step=3, group=None
    )


def _steps(model: torch.nn.Module, optimizer: OneBitAdam, steps: range) -> None:
    for step in steps:
        gen = torch.Generator().manual_seed(step)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen)
        optimizer.step()


@pytest.mark.parametrize("resume_at", [2, 5], ids=["in_warmup", "past_freeze"])
def test_onebit_adam_state_dict_continues_bit_exact(resume_at):
    """Through the trainer's flattened, name-keyed optimizer state dict (one process): a fresh
    optimizer loaded at step `resume_at` continues exactly as the uninterrupted one."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 3))
    initial = copy.deepcopy(model.state_dict())
    running = _onebit(model)
    _steps(model, running, range(resume_at))
    saved = {
        k: v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)
        for k, v in optimizer_state_dict(model, running).items()
    }
    weights = copy.deepcopy(model.state_dict())
    _steps(model, running, range(resume_at, 8))

    restarted = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 3))
    restarted.load_state_dict(initial)
    optimizer = _onebit(restarted)
    load_optimizer_state_dict(restarted, optimizer, saved)
    restarted.load_state_dict(weights)
    assert optimizer.keeps_gradients_local() == (resume_at >= 3)
    if resume_at >= 3:
        # Two compressed steps: the worker error holds something to restore. (With one rank the
        # server re-compresses values that are already +-scale: its error stays zero. The
        # 2-rank resume in test_resume_exact.py restores a non-zero one.)
        errors = [v for k, v in saved.items() if k.endswith("worker_error.rank0")]
        assert len(errors) == 4 and all(e.abs().sum() > 0 for e in errors)
    _steps(restarted, optimizer, range(resume_at, 8))
    for got, want in zip(restarted.parameters(), model.parameters(), strict=True):
        assert torch.equal(got, want)


def _dtensor_model(mesh) -> torch.nn.Module:
    """A tiny model whose parameters are DTensors as under tp: matrices Shard(0), vectors
    Replicate (on a 1-rank mesh)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 3)
    )
    for module in model:
        for name, p in list(module.named_parameters(recurse=False)):
            placement = Shard(0) if p.ndim == 2 else Replicate()
            value = distribute_tensor(p.detach().clone(), mesh, [placement])
            module.register_parameter(name, torch.nn.Parameter(value))
    return model


def _dtensor_steps(model: torch.nn.Module, optimizer: OneBitAdam, steps: range) -> None:
    from torch.distributed.tensor import distribute_tensor

    for step in steps:
        gen = torch.Generator().manual_seed(step)
        for p in model.parameters():
            grad = torch.randn(p.shape, generator=gen)
            p.grad = distribute_tensor(grad, p.device_mesh, p.placements)
        optimizer.average_gradients()
        optimizer.step()


@pytest.mark.parametrize("resume_at", [2, 5], ids=["in_warmup", "past_freeze"])
def test_onebit_adam_on_dtensors_resumes_bit_exact(resume_at):
    """Under tp (no wrapper) 1-bit Adam keeps DTensor moments and saves its error buffers as
    DTensors laid out as their parameters, through the trainer's flattened state dict; a fresh
    optimizer continues exactly (a 1-process gloo group and mesh). Its units: the replicated
    vectors apart from the sharded matrices."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from distrain.optim.onebit_adam import onebit_units

    with process_group():
        mesh = init_device_mesh("cpu", (1,))

        def build(model: torch.nn.Module) -> OneBitAdam:
            units = onebit_units(list(model.named_parameters()), lambda name: False)
            return OneBitAdam(
                param_groups(model, 0.1),
                lr=1e-2,
                betas=(0.9, 0.99),
                eps=1e-8,
                freeze_step=3,
                group=None,
                units=units,
                averages_gradients=True,
            )

        model = _dtensor_model(mesh)
        running = build(model)
        assert [len(unit) for unit in running.units] == [4, 2]  # biases + norm, matrices
        initial = copy.deepcopy(model.state_dict())
        _dtensor_steps(model, running, range(resume_at))
        saved = {
            k: v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)
            for k, v in optimizer_state_dict(model, running).items()
        }
        errors = {k: v for k, v in saved.items() if "_error" in k}
        assert len(errors) == 12 and all(isinstance(v, DTensor) for v in errors.values())
        assert errors["state.0.weight.worker_error.rank0"].placements == (
            model[0].weight.placements
        )
        if resume_at >= 3:  # past the freeze step: a worker error to restore
            assert any(v.to_local().abs().sum() > 0 for k, v in errors.items() if "worker" in k)
        weights = copy.deepcopy(model.state_dict())
        _dtensor_steps(model, running, range(resume_at, 8))

        restarted = _dtensor_model(mesh)
        restarted.load_state_dict(initial)
        optimizer = build(restarted)
        load_optimizer_state_dict(restarted, optimizer, saved)
        restarted.load_state_dict(weights)
        _dtensor_steps(restarted, optimizer, range(resume_at, 8))
        for got, want in zip(restarted.parameters(), model.parameters(), strict=True):
            assert torch.equal(got.to_local(), want.to_local())


def test_onebit_adam_loads_in_place_as_dcp_does():
    """DCP loads a checkpoint into the tensors of the fresh optimizer's own state dict, in place:
    past the freeze step the restored run continues exactly (one process), so no two entries
    of that state dict may share a tensor (the server and worker error placeholders once did)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 3))
    initial = copy.deepcopy(model.state_dict())
    running = _onebit(model)
    _steps(model, running, range(5))
    saved = {
        k: v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)
        for k, v in optimizer_state_dict(model, running).items()
    }
    weights = copy.deepcopy(model.state_dict())
    _steps(model, running, range(5, 8))

    restarted = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 3))
    restarted.load_state_dict(initial)
    optimizer = _onebit(restarted)
    target = optimizer_state_dict(restarted, optimizer)
    assert target.keys() == saved.keys()
    for key, value in target.items():
        if isinstance(value, torch.Tensor):
            value.copy_(saved[key])
    load_optimizer_state_dict(restarted, optimizer, target)
    restarted.load_state_dict(weights)
    _steps(restarted, optimizer, range(5, 8))
    for got, want in zip(restarted.parameters(), model.parameters(), strict=True):
        assert torch.equal(got, want)


def test_a_step_that_raises_while_recorded_leaves_no_recording_behind():
    """The layout's collectives are recorded by a dispatch mode entered before the step and left
    after it; a step that raises skips `after_step`, and the run's end (`close`) leaves it."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    from distrain.parallel.compress import CommStats
    from distrain.train.observers import CommMetrics

    metrics = CommMetrics(CommStats(), record_layout=True, counted=lambda: 0.0)
    metrics.start(0)
    metrics.before_step(1)
    assert _get_current_dispatch_mode() is None  # the first step is not recorded
    metrics.before_step(2)
    assert _get_current_dispatch_mode() is not None
    metrics.close()
    assert _get_current_dispatch_mode() is None and metrics.layout_bytes is None
