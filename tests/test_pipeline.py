"""Pipeline parallelism against an unsharded reference: layer split, stage placement, stage cut,
and every schedule's loss, gradients and AdamW steps on 2 gloo processes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from helpers import process_group
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from distrain.data.dataset import Batch
from distrain.errors import ConfigError
from distrain.models.decoder.model import Decoder, ModelArgs, init_weights
from distrain.models.gpt.spec import GPT_SPEC
from distrain.parallel.pipeline import SCHEDULES, PipelineRunner, split_model
from distrain.parallel.stages import stage_ids_for_rank, stage_layer_ranges

ARGS = ModelArgs(vocab_size=64, dim=32, n_layers=4, n_heads=4, ffn_dim=64, max_seq_len=16)
SEED = 7
BATCH, SEQ, MICROBATCHES, PP = 8, 16, 4, 2
# Stages per rank that each schedule needs with 4 layers on 2 ranks (interleaved: 4 stages).
STAGES_PER_RANK = {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2, "zero_bubble": 2}
# fp32 throughout; microbatching only changes matmul batch sizes, so results differ from the
# full-batch reference by rounding alone: measured loss 4.8e-7 abs (1.1e-7 relative), grads
# 2.2e-8 abs. rtol 1e-6 / atol 1e-7 (for grads near zero) leaves room for other CPUs' rounding
# and still catches any mis-scaled or missing grad (unscaled grads fail by ~1e-2).
RTOL, ATOL = 1e-6, 1e-7


def mean_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def meta_model(args: ModelArgs = ARGS) -> Decoder:
    with torch.device("meta"):
        return Decoder(args)


def materialize(module: Decoder) -> Decoder:
    module.to_empty(device="cpu")
    init_weights(module, module.args, SEED)
    return module


@pytest.mark.parametrize(
    ("n_layers", "num_stages", "sizes"),
    [(4, 4, [1, 1, 1, 1]), (8, 2, [4, 4]), (5, 2, [3, 2]), (10, 4, [2, 3, 3, 2]),
     (11, 4, [3, 3, 3, 2]), (9, 4, [2, 3, 2, 2]), (3, 1, [3])],
)  # fmt: skip
def test_stage_layer_ranges_are_contiguous_and_spare_the_ends(n_layers, num_stages, sizes):
    ranges = stage_layer_ranges(n_layers, num_stages)
    assert [len(r) for r in ranges] == sizes
    assert [i for r in ranges for i in r] == list(range(n_layers))


def test_more_stages_than_layers_is_refused():
    # The user-facing refusal is layout/rules.py's (tests/test_validation.py); this guards callers.
    with pytest.raises(ValueError, match="3 layers cannot fill 4 stages"):
        stage_layer_ranges(3, 4)


def test_stage_ids_for_rank_loop_placement():
    assert stage_ids_for_rank(1, 4, 1, "gpipe") == [1]
    assert stage_ids_for_rank(0, 2, 2, "interleaved_1f1b") == [0, 2]
    assert stage_ids_for_rank(1, 2, 3, "zero_bubble") == [1, 3, 5]
    every = sorted(s for r in range(4) for s in stage_ids_for_rank(r, 4, 2, "zero_bubble"))
    assert every == list(range(8))


@pytest.mark.parametrize("pos_emb", ["rope", "learned"])
def test_split_model_keeps_full_names_disjointly(pos_emb):
    args = ModelArgs(**{**vars(ARGS), "pos_emb": pos_emb})
    full = meta_model(args)
    stages = [split_model(full, s, 3, spec=GPT_SPEC) for s in range(3)]
    names = [set(dict(s.named_parameters())) for s in stages]
    assert set.union(*names) == set(dict(full.named_parameters()))
    assert sum(len(n) for n in names) == len(set.union(*names))
    assert [list(s.blocks.keys()) for s in stages] == [["0"], ["1", "2"], ["3"]]
    assert stages[0].tok_emb is not None and stages[1].tok_emb is None
    assert (stages[0].pos_emb is not None) == (pos_emb == "learned") and stages[2].pos_emb is None
    assert stages[2].output is not None and stages[0].norm is None and stages[1].output is None


def test_chained_stages_equal_the_full_model():
    """The cut alone, without torch's pipelining: stages run in order give the full logits."""
    tokens = torch.randint(ARGS.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(0))
    full = materialize(meta_model())
    h = tokens
    for stage_id in range(3):
        h = materialize(split_model(meta_model(), stage_id, 3, spec=GPT_SPEC))(h)
    torch.testing.assert_close(h, full(tokens), rtol=0, atol=0)


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> float:
    """Checks within RTOL/ATOL; returns the max abs difference (kept in the rank's result file)."""
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")
    return (actual - expected).abs().max().item()


def _runner(pp_mesh: DeviceMesh, schedule: str, n_microbatches: int) -> PipelineRunner:
    """A runner over freshly initialized stages: this rank's share of the full model."""
    stages_per_rank = STAGES_PER_RANK[schedule]
    stage_ids = stage_ids_for_rank(pp_mesh.get_local_rank(), PP, stages_per_rank, schedule)
    modules = [
        materialize(split_model(meta_model(), s, PP * stages_per_rank, spec=GPT_SPEC))
        for s in stage_ids
    ]
    return PipelineRunner(
        modules, stage_ids, PP * stages_per_rank, pp_mesh, schedule, n_microbatches,
        torch.device("cpu"), mean_loss,
    )  # fmt: skip


def _check_config_errors(pp_mesh: DeviceMesh, batch: Batch) -> None:
    """Microbatch counts that cannot work fail on every rank before any communication."""
    with pytest.raises(ConfigError, match="parallel.pp_microbatches"):
        _runner(pp_mesh, "1f1b", n_microbatches=1)  # 1F1B needs at least one per stage
    with pytest.raises(ConfigError, match="parallel.pp_microbatches"):
        _runner(pp_mesh, "gpipe", n_microbatches=3).train_step(*batch)  # 8 rows into 3


def _check_schedule(schedule: str, pp_mesh: DeviceMesh, batches: list[Batch]) -> dict[str, float]:
    """Pipeline vs the full model for one schedule; returns max abs differences by quantity."""
    rank = pp_mesh.get_local_rank()
    runner = _runner(pp_mesh, schedule, MICROBATCHES)
    assert runner.has_first_stage == (rank == 0) and runner.has_last_stage == (rank == PP - 1)
    reference = materialize(meta_model())
    ref_params = dict(reference.named_parameters())
    modules = runner.stage_modules
    stage_params = {n: p for m in modules for n, p in m.named_parameters()}
    pipe_opt = torch.optim.AdamW(stage_params.values(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    diffs = {"loss": 0.0, "grad": 0.0, "eval": 0.0}

    def compare_step(inputs: torch.Tensor, targets: torch.Tensor, *, grads: bool) -> None:
        ref_loss = mean_loss(reference(inputs), targets)
        ref_loss.backward()
        loss = runner.train_step(inputs, targets)
        assert (loss is None) != runner.has_last_stage
        diffs["loss"] = max(
            diffs["loss"], _assert_close(runner.broadcast_loss(loss), ref_loss.detach(), "loss")
        )
        # Only at equal weights: after AdamW steps the weights differ by rounding, which the
        # loss absorbs but single grad elements near zero need not.
        for name, param in stage_params.items() if grads else ():
            diff = _assert_close(param.grad, ref_params[name].grad, f"grad of {name}")
            diffs["grad"] = max(diffs["grad"], diff)

    compare_step(*batches[0], grads=True)
    for step, (inputs, targets) in enumerate(batches[1:]):
        for opt in (pipe_opt, ref_opt):
            opt.step()
            opt.zero_grad()
        if step == 0:  # eval between training steps: the schedule must switch mode both ways
            with torch.no_grad():
                ref_eval = mean_loss(reference(inputs), targets)
            eval_loss = runner.broadcast_loss(runner.eval_loss(inputs, targets))
            diffs["eval"] = _assert_close(eval_loss, ref_eval, "eval loss")
            with pytest.raises(ValueError, match="first batch's shape"):
                runner.eval_loss(inputs[: BATCH // 2], targets[: BATCH // 2])
        compare_step(inputs, targets, grads=False)
    return diffs


def _worker(rank: int, tmp_path: Path) -> None:
    # timeout_s: a schedule mismatch fails the test instead of hanging.
    with process_group(rank, PP, store_file=tmp_path / "store", timeout_s=60):
        torch.manual_seed(0)  # dropout-free model; this only fixes the batches, same on each rank
        mesh = init_device_mesh("cpu", (PP, 1), mesh_dim_names=("pp", "dp"))
        batches = [
            (
                torch.randint(ARGS.vocab_size, (BATCH, SEQ)),
                torch.randint(ARGS.vocab_size, (BATCH, SEQ)),
            )
            for _ in range(3)
        ]
        _check_config_errors(mesh["pp"], batches[0])
        results = {s: _check_schedule(s, mesh["pp"], batches) for s in SCHEDULES}
        (tmp_path / f"rank{rank}.json").write_text(json.dumps(results))


@pytest.mark.slow
def test_every_schedule_matches_the_full_model(tmp_path):
    """One spawn for all schedules (process start dominates); a mismatch raises in the worker.
    Each rank's result file (max differences per schedule) proves every schedule was checked."""
    mp.spawn(_worker, args=(tmp_path,), nprocs=PP, join=True)
    for rank in range(PP):
        results = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert sorted(results) == sorted(SCHEDULES)


# --- a local batch that changes size: ParallelModel.fit_pipeline_batch ---------------------

FIT_SEQ, FIT_GLOBAL, FIT_MICRO = 16, 4, 2


def _fit_config():  # -> Config
    from distrain.config.schema import Config

    cfg = Config()
    for name in ("vocab_size", "dim", "n_layers", "n_heads", "ffn_dim"):
        setattr(cfg.model, name, getattr(ARGS, name))
    cfg.model.max_seq_len = FIT_SEQ
    cfg.parallel.pp, cfg.parallel.pp_schedule = PP, "1f1b"
    t = cfg.training
    t.global_batch_size, t.micro_batch_size, t.seq_len = FIT_GLOBAL, FIT_MICRO, FIT_SEQ
    t.precision, t.compile, t.seed = "fp32", False, SEED
    return cfg


def _fit_worker(rank: int, tmp_path: Path) -> None:
    from helpers import plan_of

    from distrain.models.decoder.model import summed_next_token_loss
    from distrain.parallel.compress import CommStats
    from distrain.parallel.device import DistContext
    from distrain.parallel.parallelize import parallelize

    torch.set_num_threads(1)
    with process_group(rank, PP, store_file=tmp_path / "store", timeout_s=60):
        cfg = _fit_config()
        plan = plan_of(cfg, PP)
        mesh, dp_mesh = plan.dims.build_mesh("cpu")
        ctx = DistContext(
            rank=rank, local_rank=rank, world_size=PP, device=torch.device("cpu"), backend="gloo"
        )
        model = parallelize(plan, mesh, dp_mesh, ctx, CommStats())
        reference = Decoder(ModelArgs(**{**ARGS.__dict__, "max_seq_len": FIT_SEQ}))
        init_weights(reference, reference.args, SEED)
        gen = torch.Generator().manual_seed(0)
        tokens = torch.randint(ARGS.vocab_size, (2 * FIT_GLOBAL, FIT_SEQ + 1), generator=gen)
        # The local batch as replica groups re-split it: whole, doubled (a group left), whole.
        found: dict[str, list] = {"microbatches": [], "loss": []}
        for rows in (FIT_GLOBAL, 2 * FIT_GLOBAL, FIT_GLOBAL):
            inputs, targets = tokens[:rows, :-1], tokens[:rows, 1:]
            if found["loss"]:  # the first batch sets the schedule
                model.fit_pipeline_batch(rows)
            found["microbatches"].append(model.runner.n_microbatches)
            micro = list(zip(inputs.split(FIT_MICRO), targets.split(FIT_MICRO), strict=True))
            try:
                loss = model.forward_backward(micro, lambda x: x).item()
            except ValueError as e:  # a schedule of the wrong batch shape refuses it
                found["loss"].append(str(e))
                continue
            with torch.no_grad():
                want = summed_next_token_loss(reference(inputs), targets) / targets.numel()
            found["loss"].append((loss, want.item()))
        (tmp_path / f"fit{rank}.json").write_text(json.dumps(found))


@pytest.mark.slow
def test_a_local_batch_that_changes_size_keeps_the_microbatch_and_the_loss(tmp_path):
    """2 pp ranks, 1F1B: a local batch of 4 rows in 2 microbatches, then 8 (replica groups
    re-split the global batch when a group leaves: ParallelModel.fit_pipeline_batch), then 4
    again: the schedule runs 4 microbatches of the same size, then 2, and every step's loss is
    the 1-process model's over the same rows (no optimizer step between: the same weights)."""
    mp.spawn(_fit_worker, args=(tmp_path,), nprocs=PP, join=True)
    for rank in range(PP):
        found = json.loads((tmp_path / f"fit{rank}.json").read_text())
        assert found["microbatches"] == [2, 4, 2], (rank, found)
        for got in found["loss"]:
            assert not isinstance(got, str), (rank, got)
            assert got[0] == pytest.approx(got[1], rel=RTOL), (rank, found)
