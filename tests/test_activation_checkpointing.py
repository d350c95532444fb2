"""Activation checkpointing modes recompute what they say: counted by op, on one process.

A dispatch mode counts the aten ops one forward + backward of a tiny GPT runs. Without
checkpointing each op runs once in forward; `full` replays every block's forward in backward
(matmuls included); `selective_op` replays the cheap ops (the GELU here) but no matmul and no
attention, whose outputs it kept.
"""

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from distrain.models.decoder.model import Decoder, ModelArgs, init_weights
from distrain.parallel.activation_checkpointing import apply_activation_checkpointing

ARGS = ModelArgs(vocab_size=64, dim=32, n_layers=2, n_heads=2, ffn_dim=64, max_seq_len=16)


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _ops_and_grads(mode: str) -> tuple[Counter[str], list[torch.Tensor]]:
    model = Decoder(ARGS)
    init_weights(model, ARGS, seed=3)
    apply_activation_checkpointing(model.blocks, mode, every=2)
    tokens = torch.randint(0, ARGS.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with _CountOps() as counter:
        model(tokens).float().square().mean().backward()
    return counter.counts, [p.grad for p in model.parameters()]


@pytest.fixture(scope="module")
def runs() -> dict[str, tuple[Counter[str], list[torch.Tensor]]]:
    return {mode: _ops_and_grads(mode) for mode in ("none", "full", "selective", "selective_op")}


def test_selective_op_recomputes_cheap_ops_only(runs):
    none, full, op = runs["none"][0], runs["full"][0], runs["selective_op"][0]
    matmuls = ("mm", "addmm", "bmm")
    # full replays the blocks' forward: more matmuls than without checkpointing ...
    assert sum(full[m] for m in matmuls) > sum(none[m] for m in matmuls)
    # ... selective_op runs exactly as many as without (their outputs were saved) ...
    assert {m: op[m] for m in matmuls} == {m: none[m] for m in matmuls}
    attention = [name for name in none if "scaled_dot_product" in name and "backward" not in name]
    assert attention and all(op[name] == none[name] for name in attention)
    # ... but replays each block's GELU (one per block), which it did not keep.
    assert op["gelu"] == none["gelu"] + ARGS.n_layers


def test_every_k_checkpoints_every_kth_block(runs):
    # every=2 over 2 blocks: block 0 is replayed, block 1 is not: one extra GELU.
    assert runs["selective"][0]["gelu"] == runs["none"][0]["gelu"] + 1


@pytest.mark.parametrize("mode", ["full", "selective", "selective_op"])
def test_recomputation_gives_the_same_gradients(runs, mode):
    # The replay runs the same fp32 kernels on the same inputs: equal to the last bit.
    for got, want in zip(runs[mode][1], runs["none"][1], strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
