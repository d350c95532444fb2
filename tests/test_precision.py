"""training.precision = "auto": the device decision in parallel/mesh.py and its use by a real
run."""

from __future__ import annotations

import torch
from helpers import losses, train_in_process

from distrain.parallel.device import cpu_has_native_bf16, pick_device, resolve_precision

AVX2_ONLY = "processor\t: 0\nflags\t\t: fpu sse sse2 avx avx2 fma avx512f\n"
SAPPHIRE_RAPIDS = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"
ZEN4 = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16\n"


def test_cpu_bf16_detected_from_cpuinfo_flags():
    assert not cpu_has_native_bf16(AVX2_ONLY)
    assert cpu_has_native_bf16(SAPPHIRE_RAPIDS)
    assert cpu_has_native_bf16(ZEN4)
    # A flag named in another line (e.g. "bugs") is not a capability.
    assert not cpu_has_native_bf16("flags\t: avx2\nbugs\t: amx_bf16\n")


def test_explicit_precision_is_kept_and_auto_follows_the_device(monkeypatch):
    cpu = torch.device("cpu")
    for p in ("fp32", "bf16", "fp16"):
        assert resolve_precision(p, cpu) == p
    monkeypatch.setattr("distrain.parallel.device.cpu_has_native_bf16", lambda: True)
    assert resolve_precision("auto", cpu) == "bf16"
    monkeypatch.setattr("distrain.parallel.device.cpu_has_native_bf16", lambda: False)
    assert resolve_precision("auto", cpu) == "fp32"
    cuda = torch.device("cuda", 0)
    for native, expected in ((True, "bf16"), (False, "fp32")):
        monkeypatch.setattr(
            torch.cuda, "is_bf16_supported", lambda including_emulation=True, n=native: n
        )
        assert resolve_precision("auto", cuda) == expected


def test_auto_run_trains_as_the_resolved_precision_and_logs_it(tmp_path):
    fields = {
        "training__steps": 3,
        "training__global_batch_size": 4,
        "training__micro_batch_size": 4,
        "training__seq_len": 32,
    }
    device, _ = pick_device("auto", 0)  # the run's device: CUDA where there is one
    chosen = resolve_precision("auto", device)
    auto = train_in_process(tmp_path / "auto", training__precision="auto", **fields)
    same = train_in_process(tmp_path / "same", training__precision=chosen, **fields)
    assert losses(auto) == losses(same)
    assert len(losses(auto)) == 3
    logs = "".join(p.read_text() for p in (tmp_path / "auto").rglob("*.log"))
    assert f"training.precision auto: {chosen} on {device}" in logs
