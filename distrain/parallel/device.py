"""Devices, backends and the process groups outside the device mesh: where this process runs
(`pick_device`: CUDA with NCCL when present, else CPU with gloo: the one place that choice is
made), joining torchrun's group (`init_distributed`), the collective timeout every group gets,
the groups of checkpoints (`checkpoint_group`), stop signals (`host_group`) and replica groups
(`replica_process_group`, torchft's reconfigurable group between torchruns), and `teardown`,
the one way process groups end; and what "auto" means on a device: `resolve_precision` and
`resolve_compile` (a run decides them once, in train/resolve.py; the planner's fake builds on
the CPU decide compile here too). With parallel/mesh.py it makes every process group of a
training run; the planner, outside any run, forms its own (plan/memory.py's fake world,
plan/collectives.py's calibration processes) and destroys them.
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from distrain.errors import ConfigError


@dataclass(frozen=True)
class DistContext:
    """Where this process sits: its ranks, its device and the backend that serves it."""

    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    backend: str
    local_world_size: int = 1


CUDA_MISSING = "run.device = 'cuda' but CUDA is not available here; use auto or cpu"


def device_type(requested: str) -> str:
    """The device type run.device resolves to on this machine: auto picks cuda when present."""
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        return "cuda"
    return "cpu"


def pick_device(requested: str, local_rank: int) -> tuple[torch.device, str]:
    """Device and backend in one place: CUDA with NCCL when present, else CPU with gloo."""
    if device_type(requested) == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(CUDA_MISSING)
        return torch.device("cuda", local_rank), "nccl"
    return torch.device("cpu"), "gloo"


def cpu_has_native_bf16(cpuinfo: str | None = None) -> bool:
    """Whether this CPU multiplies bf16 matrices natively (AMX-BF16 or AVX-512 BF16), from
    torch's dispatch capability or the flags in /proc/cpuinfo (`cpuinfo` stands in for its text).
    Without them torch emulates bf16 matmuls through fp32 and autocast only adds casts."""
    if cpuinfo is None:
        if torch.backends.cpu.get_cpu_capability() == "AVX512_BF16":
            return True
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            return False
    flags = {
        word for line in cpuinfo.splitlines() if line.startswith("flags") for word in line.split()
    }
    return bool(flags & {"amx_bf16", "avx512_bf16"})


def collective_timeout(timeout_s: float) -> timedelta | None:
    """comm.collective_timeout_s as c10d wants it; None (0) leaves torch's per-backend default."""
    return timedelta(seconds=timeout_s) if timeout_s > 0 else None


def group_options(backend: str, timeout_s: float) -> tuple[str, object] | None:
    """Backend options carrying the collective timeout, for the groups DeviceMesh creates (it
    passes no timeout of its own, so they would get the backend default otherwise)."""
    timeout = collective_timeout(timeout_s)
    if timeout is None:
        return None
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
    else:
        options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    return backend, options


def init_distributed(requested_device: str, *, timeout_s: float = 0.0) -> DistContext:
    """Join the process group torchrun set up in the environment, or form a 1-process group;
    `timeout_s` (comm.collective_timeout_s) bounds each of its collectives."""
    env_rank = os.environ.get("RANK")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device, backend = pick_device(requested_device, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        if env_rank is not None:
            dist.init_process_group(
                backend,
                device_id=device if device.type == "cuda" else None,
                timeout=collective_timeout(timeout_s),
            )
        else:
            dist.init_process_group(
                backend,
                store=dist.HashStore(),
                rank=0,
                world_size=1,
                timeout=collective_timeout(timeout_s),
            )
    return DistContext(
        rank=dist.get_rank(),
        local_rank=local_rank,
        world_size=dist.get_world_size(),
        device=device,
        backend=backend,
        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size())),
    )


def replica_process_group(backend: str, timeout_s: float) -> object:
    """torchft's reconfigurable process group between replica groups, of this run's backend:
    its members change at each quorum (ft/replica_groups.py). NCCL's runs its collectives
    on the current stream like any NCCL group; a collective that errs or outlasts `timeout_s`
    marks the step for the groups to drop, instead of ending the process."""
    from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

    group = ProcessGroupNCCL if backend == "nccl" else ProcessGroupGloo
    return group(timeout=timedelta(seconds=timeout_s))


def checkpoint_group(timeout_s: float) -> dist.ProcessGroup | None:
    """The group every checkpoint collective runs on (None in a 1-process run): gloo, since
    DCP's planning and the checkpointer's verdicts move Python objects, not device tensors; its
    own group so that a background save never interleaves with training collectives (gloo has
    no mismatch error, only SIGABRT); and a timeout sized for writing or verifying a large
    checkpoint, which the default group's (10-30 minutes) is not."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))


def host_group() -> dist.ProcessGroup | None:
    """A gloo group over every rank for small host-side control messages (the stop flag), so
    they never queue behind the device's collectives nor wait on the device; None for one rank.
    Collective: every rank calls it at the same point."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    return dist.new_group(backend="gloo")


def teardown(*, synchronize: bool) -> None:
    """Destroy this process's process groups (every rank calls it last, after dropping what it
    built on them: models wrapped by DDP/FSDP, meshes, optimizers).

    The order is gloo's: a ProcessGroupGloo's destructor joins its worker threads while the
    caller holds the GIL, and a worker that still releases the tensors of a completed collective
    needs the GIL to drop their Python objects: a deadlock. It strikes when the last reference
    to a group goes at a random moment, e.g. when the cyclic GC frees a DDP reducer after
    `destroy_process_group` has dropped the group's registry entry. So: collect cycles first,
    while the registry still holds every group (nothing is destroyed), then, with
    `synchronize` (the run ended normally on every rank), wait in a barrier with the GIL
    released, during which the workers finish releasing, and only then destroy the groups. A
    failing rank skips the barrier: its peers may never reach one.
    """
    if not dist.is_initialized():
        return
    gc.collect()
    if synchronize and dist.get_world_size() > 1:
        dist.barrier()
    dist.destroy_process_group()


def resolve_precision(requested: str, device: torch.device) -> str:
    """training.precision with "auto" decided for `device`: bf16 where its matmuls run bf16
    natively (CUDA with bf16 support, or a CPU per `cpu_has_native_bf16`), else fp32."""
    if requested != "auto":
        return requested
    if device.type == "cuda":
        native = torch.cuda.is_bf16_supported(including_emulation=False)
    else:
        native = cpu_has_native_bf16()
    return "bf16" if native else "fp32"


def resolve_compile(requested: bool | str, device: torch.device) -> bool:
    """training.compile with "auto" decided for `device`: compile on CUDA, where fusing the
    elementwise work around the matmuls is the usual win (no GPU run measured it here yet);
    eager on CPU, where the default job's step measured only 1.1-1.3x faster compiled, not
    worth a cold compile of minutes (README, Benchmarks)."""
    if requested != "auto":
        return bool(requested)
    return device.type == "cuda"
