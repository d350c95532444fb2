"""DDP as distrain builds it (distrain/parallel/data_parallel.py), 3 ranks in one spawn: buckets
settled before the first real step, so a restarted process reduces gradients exactly as the run it
continues; and DDP's plain all-reduce counted without a hook, byte for byte as the hook counted.

3 ranks because with 2 the order of an element's terms cannot matter (a + b = b + a). Also,
in-process: DDP is built without torch 2.13's deprecation warning and without per-step buffer syncs.
"""

import json
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from helpers import process_group
from torch.distributed.device_mesh import init_device_mesh

from distrain.models.decoder.model import Decoder, ModelArgs, init_weights
from distrain.parallel.compress import CommStats, build_comm_hook
from distrain.parallel.data_parallel import allreduce_payload, apply_ddp, settle_bucket_layout

WORLD = 3
ARGS = dict(vocab_size=64, dim=32, n_layers=4, n_heads=4, ffn_dim=128, max_seq_len=32)
# Several buckets once rebuilt (the provisional layout of the first iteration is one bucket).
BUCKET_MB = 0.03


def _tokens(rank: int, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, ARGS["vocab_size"], (4, 17), generator=gen)


def _backward(ddp: torch.nn.Module, tokens: torch.Tensor) -> None:
    logits = ddp(tokens[:, :-1])
    F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()


def _grads(ddp: torch.nn.Module) -> list[torch.Tensor]:
    grads = [p.grad.clone() for p in ddp.parameters()]
    for p in ddp.parameters():
        p.grad = None
    return grads


def _wrapped(mesh, rank: int, *, settle: bool) -> torch.nn.Module:
    """A freshly started process's model: same weights, new DDP (new reducer)."""
    args = ModelArgs(**ARGS)
    model = Decoder(args)
    init_weights(model, args, seed=0)
    ddp = apply_ddp(model, mesh, bucket_cap_mb=BUCKET_MB, device=torch.device("cpu"))
    if settle:
        settle_bucket_layout(ddp, lambda: _backward(ddp, _tokens(rank, step=99)))
    return ddp


def _worker(rank: int, tmp_path: Path) -> None:
    torch.set_num_threads(1)
    with process_group(rank, WORLD, store_file=tmp_path / "store", timeout_s=60):
        mesh = init_device_mesh("cpu", (WORLD,))
        result = {}
        for settle in (True, False):
            # The uninterrupted run reaches step 2 after step 1; the restarted one starts there.
            running = _wrapped(mesh, rank, settle=settle)
            _backward(running, _tokens(rank, step=1))
            # Set by DDP's forward when it rebuilds (its logging data reports it a step later).
            first_step_rebuilt = int(running._has_rebuilt_buckets)
            _grads(running)
            _backward(running, _tokens(rank, step=2))
            continued = _grads(running)
            restarted = _wrapped(mesh, rank, settle=settle)
            _backward(restarted, _tokens(rank, step=2))
            resumed = _grads(restarted)
            result[f"settle={settle}"] = {
                "first_step_rebuilt": first_step_rebuilt,
                "differing": sum(
                    int((a != b).sum()) for a, b in zip(continued, resumed, strict=True)
                ),
            }
        # Byte accounting: torch's plain all-reduce counted by the hook vs from the parameters.
        ddp = _wrapped(mesh, rank, settle=True)
        stats = CommStats()
        ddp.register_comm_hook(
            *build_comm_hook("none", process_group=mesh.get_group(), stats=stats)
        )
        _backward(ddp, _tokens(rank, step=3))
        result["hook_bytes"] = stats.snapshot()["bytes_sent"]
        result["hook_fp32_bytes"] = stats.snapshot()["fp32_equivalent_bytes"]
        result["payload"] = allreduce_payload(ddp)
        result["grads_are_bucket_views"] = ddp._get_ddp_logging_data()["gradient_as_bucket_view"]
        if rank == 0:
            (tmp_path / "result.json").write_text(json.dumps(result))


@pytest.mark.slow
def test_settled_buckets_make_a_restarted_process_reduce_like_the_running_one(tmp_path):
    mp.spawn(_worker, args=(tmp_path,), nprocs=WORLD)
    result = json.loads((tmp_path / "result.json").read_text())
    settled, unsettled = result["settle=True"], result["settle=False"]
    # Settled: the first real step already runs on the rebuilt buckets, and a new process's
    # all-reduced gradients equal the running process's bit for bit.
    assert settled["first_step_rebuilt"] == 1
    assert settled["differing"] == 0
    # The control: torch's default rebuilds after the first real step, and the restarted
    # process's first reduction (provisional layout) adds some elements in another order.
    assert unsettled["first_step_rebuilt"] == 0
    assert unsettled["differing"] > 0
    # No hook on the plain path: its bytes, computed from the parameters as ParallelModel counts
    # them, are the hook's count (a ring all-reduce of every fp32 gradient on WORLD ranks).
    numel, nbytes = result["payload"]
    assert nbytes == 4 * numel
    untimed = CommStats()
    untimed.add_untimed_all_reduce(nbytes, fp32_values=numel, group_size=WORLD)
    counted = untimed.snapshot()
    # Equal up to float rounding: the hook sums per bucket, the count is one product.
    assert result["hook_bytes"] == pytest.approx(counted["bytes_sent"], rel=1e-12)
    assert result["hook_fp32_bytes"] == pytest.approx(counted["fp32_equivalent_bytes"], rel=1e-12)
    assert counted["bytes_sent"] == counted["fp32_equivalent_bytes"]
    assert counted["bytes_sent"] == pytest.approx(2 * (WORLD - 1) / WORLD * nbytes)
    assert result["grads_are_bucket_views"] == 1


def test_ddp_is_built_without_a_deprecation_warning_and_without_per_step_buffer_syncs():
    """Every DDP layout builds through apply_ddp: torch 2.13 warns on `broadcast_buffers` in each
    rank's log; the buffers (equal on every rank) are not broadcast before each forward."""
    import warnings

    with process_group():
        mesh = init_device_mesh("cpu", (1,))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ddp = _wrapped(mesh, 0, settle=False)
        assert [str(w.message) for w in caught if w.category is FutureWarning] == []
        assert ddp.forward_sync_buffers is False
