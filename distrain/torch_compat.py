"""Every private torch API distrain relies on, each behind one small function or name here.

torch does not promise these across releases (an underscore, or a module under `_`), so when a
torch upgrade breaks one, this file and tests/test_torch_compat.py (one test each) are the
places to look. It is also the one place that knows how the supported torch releases
(pyproject.toml: >=2.11,<2.15) differ: each difference below names the releases and the test
that holds it. CI runs the whole suite on torch 2.13 and the compat suite (`pytest -m compat`,
this file's tests among it) on 2.11 and 2.14, the ends of the range; 2.12 is not run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from distrain.version import torch_release

# Imported on first use (`from distrain.torch_compat import FsspecReader` works): DCP's fsspec
# module pulls in fsspec and DCP, seconds of import that parallel/mesh.py's users should not pay.
_LAZY = {
    "FsspecReader": "torch.distributed.checkpoint._fsspec_filesystem",
    "FsspecWriter": "torch.distributed.checkpoint._fsspec_filesystem",
}


def __getattr__(name: str) -> Any:
    """DCP's fsspec reader and writer (a private module in torch 2.13)."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def flatten_mesh(mesh: DeviceMesh, name: str, *, backend_override: Any = None) -> DeviceMesh:
    """One axis made of all of `mesh`'s axes (`DeviceMesh._flatten`: torchtitan uses it for its
    flattened data-parallel axis; no public equivalent in torch 2.13); `backend_override`: the
    new group's backend options (its timeout), as init_device_mesh takes them."""
    return mesh._flatten(name, backend_override=backend_override)


def flattened_submesh(mesh: DeviceMesh, names: str | tuple[str, ...]) -> DeviceMesh:
    """`mesh[names]` where a name is an axis `flatten_mesh` made. torch 2.13 warns on every such
    slice that slicing a flattened axis from the root mesh is to be deprecated (torch wants the
    flattened mesh kept by its maker); the slice works, and the warning, printed once per rank
    and run, is silenced here until distrain keeps the flattened meshes itself."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="Slicing a flattened dim from root mesh", category=UserWarning
        )
        return mesh[names]


def dcp_metadata_path(reader: Any, rank: int | None) -> os.PathLike | str:
    """Where a DCP FileSystemReader/FsspecReader reads its metadata file
    (`FileSystemReader._get_metadata_path`), for readers that load it themselves."""
    return reader._get_metadata_path(rank)


def set_nested_element(root: dict[str, Any], path: tuple[str | int, ...], value: object) -> None:
    """DCP's own way to put a value at a flattened state-dict path back into the nested dict
    (`torch.distributed.checkpoint._nested_dict.set_element`), as DefaultLoadPlanner does."""
    from torch.distributed.checkpoint._nested_dict import set_element

    set_element(root, path, value)


def checkpoint_wrapper(
    module: nn.Module, *, preserve_rng_state: bool, context_fn: Callable[[], Any] | None = None
) -> nn.Module:
    """Activation checkpointing around `module` (torch's private `checkpoint_wrapper`, the one
    FSDP2 and torchtitan use): its state_dict keys stay those of `module`. `context_fn`: passed
    to `torch.utils.checkpoint.checkpoint` (selective checkpointing's policy contexts)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        checkpoint_wrapper as wrap,
    )

    if context_fn is None:
        return wrap(module, preserve_rng_state=preserve_rng_state)
    return wrap(module, preserve_rng_state=preserve_rng_state, context_fn=context_fn)


# What DDP (`module`), compile (`_orig_mod`, private) and `checkpoint_wrapper` (private) put
# before the names of the parameters of the module they wrap.
WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "module.")


def dtensor_storage(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor holding `t`'s bytes on this rank: a DTensor's local tensor as it is
    (`_local_tensor`, no view or autograd node made, as inside a dispatch mode), else `t`.
    DTensor is imported here, not with this module: it costs the CLI's start 0.6 s."""
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


def canonical_name(name: str) -> str:
    """A parameter's name with wrapper prefixes (DDP, compile, activation checkpointing) removed."""
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def is_zero_redundancy_optimizer(optimizer: torch.optim.Optimizer) -> bool:
    """isinstance(optimizer, ZeroRedundancyOptimizer) without importing it (a slow import) when
    nothing has: an optimizer can only be one if its module is loaded."""
    module = sys.modules.get("torch.distributed.optim.zero_redundancy_optimizer")
    return module is not None and isinstance(optimizer, module.ZeroRedundancyOptimizer)


@contextlib.contextmanager
def device_meshes_under_fake_mode() -> Iterator[None]:
    """DeviceMeshes can be made and read inside a FakeTensorMode for this block. torch 2.13's
    DeviceMesh finds this rank's place with `nonzero` on its rank tensors (the `mesh` property,
    on a mesh cut from a larger one; `_compute_coordinate_on_dim`, in `__init__`), an op with a
    data-dependent shape that fake tensors refuse (DynamicOutputShapeException); FSDP2 makes
    such a mesh (`DeviceMesh._concatenate` of the dp and tp meshes) for every DTensor parameter
    it shards, so tp x FSDP could not be built on fake tensors. Those tensors come from the
    mesh's real rank map: both are computed on them with the fake mode set aside."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    mesh, coordinate = DeviceMesh.mesh, DeviceMesh._compute_coordinate_on_dim

    def real_mesh(self: DeviceMesh) -> torch.Tensor:
        with unset_fake_temporarily():
            return mesh.fget(self)

    def real_coordinate(self: DeviceMesh) -> tuple[int, ...] | None:
        with unset_fake_temporarily():
            return coordinate(self)

    DeviceMesh.mesh, DeviceMesh._compute_coordinate_on_dim = property(real_mesh), real_coordinate
    try:
        yield
    finally:
        DeviceMesh.mesh, DeviceMesh._compute_coordinate_on_dim = mesh, coordinate


def forget_dtensor_meshes() -> None:
    """Empty DTensor's caches of sharding decisions and redistribution plans
    (`torch.distributed.tensor.debug._clear_sharding_prop_cache`,
    `_redistribute.clear_redistribute_planner_cache`). Their keys compare meshes by layout
    alone, so after the process group is destroyed and another made (the planner's fake world
    per layout) a cached spec hands back a mesh of the old group: its collectives name a
    process group that no longer exists, and its coordinate is the old rank's."""
    from torch.distributed.tensor._redistribute import clear_redistribute_planner_cache
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
    clear_redistribute_planner_cache()


def is_fake(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is a fake tensor: shapes without values, as in the planner's fake builds
    (`torch._subclasses.fake_tensor.is_fake`)."""
    from torch._subclasses.fake_tensor import is_fake as fake

    return fake(tensor)


# --- differences between the supported releases ------------------------------------------------


def ddp_without_forward_buffer_sync() -> dict[str, bool]:
    """DistributedDataParallel's keyword arguments for "no buffer broadcast before each forward"
    (buffers equal on every rank: a collective per step for nothing). torch 2.13 and 2.14 have
    `forward_sync_buffers=False` and deprecate `broadcast_buffers=False` with a warning in every
    log; torch 2.11 has only `broadcast_buffers` (which also skips the one broadcast at
    construction: the buffers are equal anyway). Decided by DDP's own signature."""
    from torch.nn.parallel import DistributedDataParallel

    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters:
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}


def torchrun_shutdown_timeout(seconds: int) -> list[str]:
    """torchrun's option for how long its agent waits, after a stop signal, for the workers to
    exit before it kills them (`--shutdown-timeout`, torch 2.13 and 2.14; decided by the field
    of the same name in `torch.distributed.launcher.api.LaunchConfig`). torch 2.11's torchrun
    has no such option: its agent waits a fixed 30 s there, so a preempt checkpoint must commit
    within 30 s of the signal whatever `checkpoint.preempt_grace_s` says."""
    from torch.distributed.launcher.api import LaunchConfig

    if "shutdown_timeout" in {f.name for f in dataclasses.fields(LaunchConfig)}:
        return [f"--shutdown-timeout={seconds}"]
    return []


# One tensor gathered from every rank into one (concatenated along dim 0), and its inverse: torch
# 2.13 and 2.14 name them `all_gather_single` and `reduce_scatter_single` (and deprecate the old
# names with a warning per call); torch 2.11 has only `all_gather_into_tensor` and
# `reduce_scatter_tensor`, the same arguments. Decided by which name torch.distributed has.
all_gather_single: Callable[..., Any] = (
    getattr(torch.distributed, "all_gather_single", None)
    or torch.distributed.all_gather_into_tensor
)
reduce_scatter_single: Callable[..., Any] = (
    getattr(torch.distributed, "reduce_scatter_single", None)
    or torch.distributed.reduce_scatter_tensor
)


# torch 2.11's DefaultStager closes its StateDictStager at the end of every stage() (emptying the
# deep-copy dispatch table it stages with): a second stage() of the same stager raises
# KeyError(<class 'type'>). torch 2.13 and 2.14 keep it open, with the host buffers, across
# stages. 2.12 is not run in CI: it takes 2.11's path, correct on every release (a new stager
# per copy only forgoes the buffers' reuse).
_STAGER_STAGES_ONCE = torch_release() < (2, 13)


class DefaultStager:
    """DCP's DefaultStager (same StagingOptions), staging any number of times: on a torch
    whose stager stages once (2.11), a new one per stage()."""

    def __init__(self, options: Any):
        from torch.distributed.checkpoint.staging import DefaultStager as Stager

        self._make = lambda: Stager(options)
        self._stager = self._make()

    def stage(self, state: dict[str, Any]) -> dict[str, Any]:
        if _STAGER_STAGES_ONCE:
            self._stager.close()
            self._stager = self._make()
        return self._stager.stage(state)  # type: ignore[return-value]

    def close(self) -> None:
        self._stager.close()
