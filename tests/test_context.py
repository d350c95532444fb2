"""Context parallelism's pieces, in one process: the load-balanced split, the reordering of the
gathered chunks, and each rank's attention against the unsplit causal attention (forward and
gradients). The collective itself runs in the cp parity rows of tests/test_parity.py and in the
cp2 -> 1 process resume here."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import losses, train_cli, train_in_process
from test_parity import BASE, assert_parity

from distrain.config.schema import Config
from distrain.models.decoder.model import Decoder, ModelArgs, init_weights
from distrain.models.registry import model_args
from distrain.observe.metrics import read_metrics
from distrain.optim.builder import build_optimizer
from distrain.parallel.attention_blocks import chunk_order, local_positions
from distrain.parallel.context import attend_local, gathered_to_sequence
from distrain.parallel.mesh import ParallelDims
from distrain.plan.memory import fake_world

CPU = torch.device("cpu")


@pytest.mark.parametrize("size", [1, 2, 4])
def test_split_covers_the_sequence_once_and_balances_causal_work(size):
    seq = 8 * size
    parts = [local_positions(seq, r, size, CPU) for r in range(size)]
    assert sorted(torch.cat(parts).tolist()) == list(range(seq))
    # Causal work of a query at position p: p + 1 keys. Every rank gets the same total.
    work = {int((p + 1).sum()) for p in parts}
    assert len(work) == 1, work


def test_chunk_order_pairs_early_with_late():
    assert [chunk_order(r, 4) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]


def _shards(x: torch.Tensor, size: int) -> list[torch.Tensor]:
    """Each rank's slice [B, H, 2c, D] of x [B, H, T, D]."""
    return [x[:, :, local_positions(x.shape[2], r, size, CPU)] for r in range(size)]


@pytest.mark.parametrize("size", [2, 3])
def test_gathered_chunks_are_put_back_in_sequence_order(size):
    x = torch.randn(2, 3, 12 * size, 4)
    gathered = torch.stack(_shards(x, size))
    assert torch.equal(gathered_to_sequence(gathered, size), x)


def full_attention_reference(size: int):
    """q, k, v [2, 4, 16 size, 8] (float64), the unsplit causal attention's output, output
    weights, and the gradients of (output x weights).sum() with respect to q, k and v."""
    torch.manual_seed(0)
    q, k, v = (
        torch.randn(2, 4, 16 * size, 8, dtype=torch.float64, requires_grad=True) for _ in "qkv"
    )
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    weights = torch.randn_like(out)
    grads = torch.autograd.grad((out * weights).sum(), (q, k, v))
    return (q.detach(), k.detach(), v.detach()), out.detach(), weights, grads


@pytest.mark.parametrize(
    ("size", "block"),
    [(2, 512), (2, 3), (4, 4)],
    ids=["one_block", "blocks_straddling_chunks", "blocks_within_chunks"],
)
def test_each_rank_attention_equals_its_rows_of_full_causal_attention(size, block):
    (q, k, v), reference, weights, want = full_attention_reference(size)
    q_shards = [s.requires_grad_() for s in _shards(q, size)]
    k_seq, v_seq = (t.clone().requires_grad_() for t in (k, v))
    total = 0
    for rank, q_local in enumerate(q_shards):
        out = attend_local(q_local, k_seq, v_seq, rank, size, block=block)
        rows = local_positions(q.shape[2], rank, size, CPU)
        # float64: only the summation order differs from the unsplit kernel.
        torch.testing.assert_close(out, reference[:, :, rows], rtol=1e-12, atol=1e-12)
        total = total + (out * weights[:, :, rows]).sum()
    total.backward()
    q_grad = torch.zeros_like(q)
    for rank, q_local in enumerate(q_shards):
        q_grad[:, :, local_positions(q.shape[2], rank, size, CPU)] = q_local.grad
    for got, expected in zip((q_grad, k_seq.grad, v_seq.grad), want, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("pos_emb", ["rope", "learned"])
def test_model_given_global_positions_matches_the_whole_sequence(pos_emb):
    """A model run on a rank's columns with their global positions gives those columns' logits
    of the unsplit run. The all-gather is replaced by the unsplit run's keys and values of
    each layer (what the collective hands every rank), so positions and masking are what is
    tested here."""
    args = ModelArgs(dim=32, n_layers=2, n_heads=2, ffn_dim=64, max_seq_len=64, pos_emb=pos_emb)
    model = Decoder(args)
    init_weights(model, args, seed=3)
    tokens = torch.randint(0, args.vocab_size, (2, 32))
    recorded = []

    def record(q, k, v):
        recorded.append((k, v))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    for block in model.blocks.values():
        block.attn.attend = record
    full = model(tokens)
    size = 2
    for rank in range(size):
        positions = local_positions(32, rank, size, CPU)
        layers = iter(recorded)

        def replay(q, k, v, rank=rank, layers=layers):
            k_seq, v_seq = next(layers)
            return attend_local(q, k_seq, v_seq, rank, size)

        for block in model.blocks.values():
            block.attn.attend = replay
        got = model(tokens[:, positions], positions=positions)
        # fp32, the same ops on the same values; only the attention's summation order differs.
        torch.testing.assert_close(got, full[:, positions], rtol=1e-5, atol=1e-6)


def test_zero1_shards_the_optimizer_state_over_dp_x_cp():
    """cp2 x dp2 under DDP: ZeRO-1's group is all 4 ranks (the gradients' dp x cp), so the 4
    ranks own every parameter once between them (over dp alone they would own it twice);
    under FSDP2 (tp), which shards over cp itself, the group is dp. Each rank as torch's fake
    process group of 4 sees it (the collectives return at once)."""
    cfg = Config()
    cfg.parallel.cp, cfg.parallel.zero_stage = 2, 1
    total = sum(p.numel() for p in Decoder(model_args(cfg.model)).parameters())
    owned = 0
    for rank in range(4):
        with fake_world(4, rank):
            dims = ParallelDims.from_config(cfg.parallel, 4, optimizer_averages=False)
            mesh, dp_mesh = dims.build_mesh("cpu")
            zero1 = dims.zero1_mesh(mesh, dp_mesh)
            assert (dims.dp_wrapper, dp_mesh.size(), zero1.size()) == ("ddp", 2, 4)
            optimizer = build_optimizer(
                Decoder(model_args(cfg.model)), cfg.optim, zero1_group=zero1.get_group()
            )
            owned += sum(p.numel() for g in optimizer.optim.param_groups for p in g["params"])
    assert owned == total
    cfg.parallel.tp = 2
    with fake_world(4):
        dims = ParallelDims.from_config(cfg.parallel, 4, optimizer_averages=False)
        mesh, dp_mesh = dims.build_mesh("cpu")
        assert dims.dp_wrapper == "fsdp" and dims.zero1_mesh(mesh, dp_mesh) is dp_mesh


@pytest.mark.slow
def test_resume_cp2_on_one_process(tmp_path):
    """A cp2 run's checkpoint resumes on one process without cp: parameters and optimizer state
    are saved as they are without context parallelism, and the stitched loss curve is the
    uninterrupted 1-process curve."""
    reference = losses(
        train_in_process(tmp_path / "ref", **dict(BASE, training__micro_batch_size=8))
    )
    run = tmp_path / "run"
    fields = dict(BASE, checkpoint__interval_steps=2)
    first = train_cli(run, 2, **fields, parallel__cp=2, debug__fail_at_step=5)
    assert first.returncode != 0
    rows = train_in_process(run, **dict(fields, training__micro_batch_size=8))
    assert [r["resumed_from"] for r in rows if "resumed_from" in r] == [4]
    assert_parity(losses(read_metrics(run / "metrics.jsonl")), reference)
