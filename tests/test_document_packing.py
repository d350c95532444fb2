"""Document-aware packing: document ids from boundaries or an end-of-document token, attention
that never crosses a document (plain SDPA, both context-parallel kernels, pipeline stages), and
a loss that is the mean over the global batch's targets whatever the split.

One 4-rank launch (module fixture) serves every multi-process assertion: each layout's loss and
gradients against the 1-process ones within 1e-6, and the cp2 / pp2 document checks.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from helpers import plan_of, process_group
from torch.distributed.tensor import DTensor

from distrain.config.schema import Config, DataConfig
from distrain.data.corpus import DataError
from distrain.data.dataset import TokenDataset, build_datasets
from distrain.data.documents import IGNORE_INDEX, DocumentIndex
from distrain.errors import ConfigError
from distrain.launch.preflight import preflight
from distrain.models.decoder.model import Decoder, ModelArgs, init_weights, summed_next_token_loss
from distrain.parallel.attention_blocks import local_positions
from distrain.parallel.compress import CommStats
from distrain.parallel.context import attend_local
from distrain.parallel.device import DistContext
from distrain.parallel.parallelize import parallelize
from distrain.torch_compat import canonical_name

WORLD = 4
SEED = 3
SEQ, GLOBAL, MICRO = 32, 16, 2
EOS = 0
# fp32 sums in another order (all-reduce, reduce-scatter, row-parallel partial sums, blockwise
# attention): ~1e-7 relative measured; the per-micro-batch mean misses by ~1e-2.
BOUND = 1e-6
# Tiny GPT: 4 layers so that pp2 with two stages per rank has a layer per stage.
MODEL = {"dim": 32, "n_layers": 4, "n_heads": 2, "ffn_dim": 64, "max_seq_len": SEQ}
LAYOUTS = {
    "dp4": {},
    "zero3_dp4": {"zero_stage": 3},
    "tp2_sp_dp2": {"tp": 2},
    "pp2_1f1b_dp2": {"pp": 2, "pp_schedule": "1f1b"},
    "pp2_interleaved_dp2": {
        "pp": 2,
        "pp_schedule": "interleaved_1f1b",
        "pp_stages_per_rank": 2,
    },
    "cp2_ring_dp2": {"cp": 2, "cp_method": "ring"},
    "cp2_allgather_pp2": {"cp": 2, "pp": 2, "pp_schedule": "gpipe"},
}


def _stream(num_tokens: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, boundaries): documents of very unequal lengths (1 to 40 tokens), each ending in
    EOS, so samples hold unequally many targets."""
    rng = np.random.default_rng(seed)
    lengths = []
    while sum(lengths) < num_tokens:
        lengths.append(int(rng.choice([1, 2, 3, 40])) if rng.random() < 0.5 else 40)
    tokens = rng.integers(1, 256, sum(lengths))
    boundaries = np.concatenate([[0], np.cumsum(lengths)])
    tokens[boundaries[1:] - 1] = EOS
    return tokens[:num_tokens], np.minimum(boundaries, num_tokens)


def _global_batch() -> tuple[torch.Tensor, ...]:
    """(inputs, targets, documents) of the global batch, from TokenDataset with boundaries."""
    tokens, boundaries = _stream(GLOBAL * SEQ + 1, SEED)
    dataset = TokenDataset(
        tokens, [(0, len(tokens))], SEQ, documents=DocumentIndex(boundaries=boundaries)
    )
    return dataset.get_batch(np.arange(GLOBAL))


def _model_args() -> ModelArgs:
    return ModelArgs(**MODEL)


def _reference(batch: tuple[torch.Tensor, ...], *, split: int | None = None) -> tuple:
    """(loss, {name: grad}) of one process over the whole batch: the mean over its targets; or,
    with `split`, the per-micro-batch mean of micro-batches of `split` rows averaged (the
    normalization transformers once shipped), the broken variant."""
    args = _model_args()
    model = Decoder(args)
    init_weights(model, args, SEED)
    inputs, targets, documents = batch
    if split is None:
        loss = summed_next_token_loss(model(inputs, documents=documents), targets)
        loss = loss / (targets >= 0).sum()
    else:
        parts = [t.split(split) for t in batch]
        means = [
            summed_next_token_loss(model(x, documents=d), y) / (y >= 0).sum()
            for x, y, d in zip(*parts, strict=True)
        ]
        loss = torch.stack(means).mean()
    loss.backward()
    return loss.item(), {name: p.grad for name, p in model.named_parameters()}


def _relative(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """max |got - want| / max |want| over the tensors `got` names."""
    scale = max(w.abs().max().item() for w in want.values())
    return max((got[n] - want[n]).abs().max().item() for n in got) / scale


def _config(parallel: dict) -> Config:
    cfg = Config()
    for name, value in MODEL.items():
        setattr(cfg.model, name, value)
    for name, value in parallel.items():
        setattr(cfg.parallel, name, value)
    t = cfg.training
    t.global_batch_size, t.micro_batch_size, t.seq_len = GLOBAL, MICRO, SEQ
    t.precision, t.compile, t.seed = "fp32", False, SEED
    cfg.data.document_masking = True
    return cfg


def _full_grads(model) -> dict[str, torch.Tensor]:
    grads = {}
    for part in model.parts:
        for name, p in part.named_parameters():
            grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            grads[canonical_name(name)] = grad
    return grads


def _layout_parity(rank: int, parallel: dict, batch, want_loss, want_grads) -> dict:
    """This layout's loss and gradients for the global batch against the 1-process ones."""
    plan = plan_of(_config(parallel), WORLD)
    dims = plan.dims
    mesh, dp_mesh = dims.build_mesh("cpu")
    ctx = DistContext(
        rank=rank, local_rank=rank, world_size=WORLD, device=torch.device("cpu"), backend="gloo"
    )
    model = parallelize(plan, mesh, dp_mesh, ctx, CommStats())
    rows = GLOBAL // dims.dp_size
    mine = slice(dp_mesh.get_local_rank() * rows, (dp_mesh.get_local_rank() + 1) * rows)
    batches = list(zip(*(t[mine].split(MICRO) for t in batch), strict=True))
    grad_group = dims.gradient_mesh(mesh, dp_mesh).get_group()
    share = model.target_share(batches, grad_group)
    loss = model.forward_backward(batches, lambda x: x, target_share=share)
    dist.all_reduce(loss)  # the trainer's logged loss: the mean over every rank
    result = {
        "loss": abs(loss.item() / WORLD - want_loss) / want_loss,
        "grad": _relative(_full_grads(model), want_grads),
    }
    if dims.cp > 1 and dims.pp == 1:
        result["cp_second_document"] = _cp_second_document(model, mesh)
    if dims.pp > 1 and dims.cp == 1:
        result.update(_pp_documents(model))
    return result


def _two_documents() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A packed row [1, SEQ] of two documents (lengths 11 and SEQ - 11), its document ids, and
    the two documents alone."""
    gen = torch.Generator().manual_seed(7)
    packed = torch.randint(1, 256, (1, SEQ), generator=gen)
    documents = (torch.arange(SEQ) >= 11).long()[None]
    return packed, documents, packed[:, :11], packed[:, 11:]


def _cp_second_document(model, mesh) -> float:
    """Max |logit difference| of the second document's positions that this cp rank holds,
    packed (with document ids) against that document alone on one process."""
    packed, documents, _, second = _two_documents()
    args = _model_args()
    alone_model = Decoder(args)
    init_weights(alone_model, args, SEED)
    alone = alone_model(second).detach()
    cp = mesh["cp"]
    positions = local_positions(SEQ, cp.get_local_rank(), cp.size(), torch.device("cpu"))
    model.train(False)
    with torch.no_grad():
        logits = model.parts[0](packed[:, positions], positions=positions, documents=documents)
    model.train(True)
    logits = logits.full_tensor() if isinstance(logits, DTensor) else logits
    held = positions >= 11
    return (logits[:, held] - alone[:, positions[held] - 11]).abs().max().item()


def _pp_documents(model) -> dict[str, float]:
    """The pipeline's summed evaluation loss of packed rows of two documents, with document ids
    and without, against the two documents' summed losses each alone on one process: the first
    must match (a document's first token is no target), the second must not."""
    packed, documents, first, second = _two_documents()
    args = _model_args()
    alone_model = Decoder(args)
    init_weights(alone_model, args, SEED)
    with torch.no_grad():
        want = sum(
            summed_next_token_loss(alone_model(d[:, :-1]), d[:, 1:]).item() for d in (first, second)
        )
    rows = model.train_batch_rows
    targets = torch.cat([packed[:, 1:], torch.full((1, 1), IGNORE_INDEX)], dim=1)
    targets[0, 10] = IGNORE_INDEX  # the second document's first token
    inputs, targets, documents = (t.repeat(rows, 1) for t in (packed, targets, documents))
    masked = model.eval_loss([(inputs, targets, documents)])
    unmasked = model.eval_loss([(inputs, targets)])
    return {
        "pp_masked": abs(masked[0].item() / rows - want) / want,
        "pp_unmasked": abs(unmasked[0].item() / rows - want) / want,
    }


def _worker(rank: int, out: Path) -> None:
    torch.set_num_threads(1)
    with process_group(rank, WORLD, store_file=out / "store", timeout_s=120):
        batch = _global_batch()
        want_loss, want_grads = _reference(batch)
        results = {
            name: _layout_parity(rank, parallel, batch, want_loss, want_grads)
            for name, parallel in LAYOUTS.items()
        }
        (out / f"rank{rank}.json").write_text(json.dumps(results))
        dist.barrier()


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("packing")
    mp.spawn(_worker, args=(out,), nprocs=WORLD)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


# --- one process ---------------------------------------------------------------------------


def test_document_ids_from_boundaries_equal_those_from_the_end_token() -> None:
    tokens, boundaries = _stream(500, seed=1)
    starts = np.array([0, 37, 100, 411])
    windows = tokens[starts[:, None] + np.arange(SEQ + 1)]
    by_bounds = DocumentIndex(boundaries=boundaries).window_ids(starts, windows)
    by_eos = DocumentIndex(eos_id=EOS).window_ids(starts, windows)
    np.testing.assert_array_equal(by_bounds, by_eos)
    dataset = TokenDataset(
        tokens, [(0, len(tokens))], SEQ, documents=DocumentIndex(boundaries=boundaries)
    )
    inputs, targets, documents = dataset.get_batch([0, 3])
    plain_inputs, plain_targets = TokenDataset(tokens, [(0, len(tokens))], SEQ).get_batch([0, 3])
    assert torch.equal(inputs, plain_inputs)
    # A document starts after each EOS; the target of an EOS (that start) is left out.
    starts_doc = documents[:, 1:] != documents[:, :-1]
    assert torch.equal(starts_doc, plain_inputs[:, :-1] == EOS) and starts_doc.any()
    ignored = targets == IGNORE_INDEX
    assert torch.equal(ignored[:, :-1], starts_doc)
    assert torch.equal(targets[~ignored], plain_targets[~ignored])


def test_prepared_boundaries_are_read_and_their_absence_names_the_fields(tmp_path) -> None:
    tokens, boundaries = _stream(4000, seed=2)
    data = tmp_path / "data.npy"
    np.save(data, tokens.astype(np.uint16))
    cfg = DataConfig(path=str(data), format="tokens", document_masking=True)
    with pytest.raises(DataError, match="data.eos_id"):
        build_datasets(cfg, SEQ)
    run = Config(data=cfg)
    run.run.dir = str(tmp_path / "run")
    with pytest.raises(ConfigError, match="data.eos_id"):
        preflight(run)  # before any worker starts
    np.save(tmp_path / "data.npy.docs.npy", boundaries)
    train, _ = build_datasets(cfg, SEQ)
    by_file = train.get_batch([0, 1])[2]
    cfg.eos_id = EOS
    (tmp_path / "data.npy.docs.npy").unlink()
    assert torch.equal(build_datasets(cfg, SEQ)[0].get_batch([0, 1])[2], by_file)
    np.save(tmp_path / "data.npy.docs.npy", boundaries[::-1])
    with pytest.raises(DataError, match="prepare the data again"):
        build_datasets(cfg, SEQ)


def test_packed_document_logits_equal_the_document_alone() -> None:
    """RoPE depends on relative positions only, so the second document needs no position reset;
    without document ids its logits see the first document and differ."""
    packed, documents, first, second = _two_documents()
    args = _model_args()
    model = Decoder(args)
    init_weights(model, args, SEED)
    with torch.no_grad():
        masked = model(packed, documents=documents)
        unmasked = model(packed)
        alone = model(first), model(second)
    torch.testing.assert_close(masked[:, :11], alone[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(masked[:, 11:], alone[1], rtol=0, atol=1e-5)
    assert (unmasked[:, 11:] - alone[1]).abs().max() > 1e-2


@pytest.mark.parametrize("size", [1, 2])
def test_blockwise_attention_within_documents_equals_masked_sdpa(size) -> None:
    """Each cp rank's blockwise attention (blocks of 4, so whole blocks of other documents are
    skipped through -inf without NaN) against SDPA with the block-diagonal causal mask, forward
    and backward, in fp64 so that only a wrong mask could differ."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(2, 2, SEQ, 8, generator=gen, dtype=torch.float64, requires_grad=True)
        for _ in range(3)
    )
    documents = torch.tensor([[0] * 9 + [1] * 2 + [2] * 21, [0] * 30 + [1] * 2])
    mask = (documents[:, None, :, None] == documents[:, None, None, :]) & torch.ones(
        SEQ, SEQ, dtype=torch.bool
    ).tril()
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    grad_out = torch.randn(want.shape, generator=gen, dtype=torch.float64)
    want_grads = torch.autograd.grad(want, (q, k, v), grad_out)
    got_grads = [torch.zeros_like(t) for t in (q, k, v)]
    for rank in range(size):
        positions = local_positions(SEQ, rank, size, torch.device("cpu"))
        out = attend_local(q[:, :, positions], k, v, rank, size, block=4, documents=documents)
        torch.testing.assert_close(out, want[:, :, positions], rtol=0, atol=1e-12)
        for total, g in zip(
            got_grads, torch.autograd.grad(out, (q, k, v), grad_out[:, :, positions]), strict=True
        ):
            total += g
    for got, expected in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


def test_the_per_micro_batch_mean_misses_the_bound() -> None:
    """The broken normalization, on the same data and bound as the layouts below: averaging the
    micro-batches' means weighs a target by 1 / its micro-batch's count."""
    batch = _global_batch()
    counts = [(y >= 0).sum().item() for y in batch[1].split(MICRO)]
    assert len(set(counts)) > 1, counts  # the micro-batches hold unequally many targets
    want_loss, want_grads = _reference(batch)
    broken_loss, broken_grads = _reference(batch, split=MICRO)
    assert abs(broken_loss - want_loss) / want_loss > BOUND
    assert _relative(broken_grads, want_grads) > 100 * BOUND


# --- four processes ------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_loss_and_gradients_equal_one_process(layout, launched) -> None:
    for rank, results in enumerate(launched):
        got = results[layout]
        assert got["loss"] <= BOUND, (rank, got)
        assert got["grad"] <= BOUND, (rank, got)


@pytest.mark.slow
def test_cp2_second_document_logits_equal_the_document_alone(launched) -> None:
    for results in launched:
        assert results["cp2_ring_dp2"]["cp_second_document"] <= 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["pp2_1f1b_dp2", "pp2_interleaved_dp2"])
def test_pp2_packed_loss_equals_the_documents_alone(layout, launched) -> None:
    for results in launched:
        got = results[layout]
        assert got["pp_masked"] <= BOUND, got
        assert got["pp_unmasked"] > 100 * BOUND, got
