"""distrain/torch_compat.py: each private torch API distrain relies on still does what distrain
needs from it, on the torch CI runs. One process (a 1-rank gloo group where one is needed)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import process_group
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.device_mesh import init_device_mesh

from distrain import torch_compat

# In the compat suite (.ci/run: also on the oldest and newest torch): the private APIs.
pytestmark = pytest.mark.compat


@pytest.fixture
def one_rank():
    with process_group(timeout_s=30):
        yield


def test_flatten_mesh_names_one_axis_of_all(one_rank):
    mesh = init_device_mesh("cpu", (1, 1, 1), mesh_dim_names=("pp", "dp_replicate", "dp_shard"))
    flat = torch_compat.flatten_mesh(mesh["dp_replicate", "dp_shard"], "dp")
    assert flat.mesh_dim_names == ("dp",) and flat.size() == 1


def test_dtensor_storage_is_the_local_tensor_itself(one_rank):
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    whole = torch.arange(6.0).reshape(2, 3)
    sharded = distribute_tensor(whole, mesh, [Shard(0)])
    local = torch_compat.dtensor_storage(sharded)
    assert type(local) is torch.Tensor and torch.equal(local, whole)
    assert local.untyped_storage()._cdata == sharded.to_local().untyped_storage()._cdata
    assert torch_compat.dtensor_storage(whole) is whole


def test_a_flattened_axis_is_sliced_without_a_warning():
    """Context parallelism's meshes (dp x cp for DDP, dp_shard x cp for FSDP2, HSDP's pair) are
    slices of flattened axes: torch 2.13 warns on each (the cp run printed it once per rank)."""
    import warnings

    from distrain.parallel.mesh import ParallelDims
    from distrain.plan.memory import fake_world

    dims = ParallelDims(
        pp=1, dp_replicate=2, dp_shard=2, tp=1, zero_stage=3, world_size=8, dp_wrapper="fsdp", cp=2
    )
    with fake_world(8), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mesh, dp_mesh = dims.build_mesh("cpu")
        assert dims.gradient_mesh(mesh, dp_mesh).size() == 8
        assert dims.fsdp_mesh(mesh).mesh_dim_names == ("dp_replicate", "dp_shard_cp")
    assert not [w for w in caught if "flattened dim" in str(w.message)], caught


def test_device_meshes_under_fake_mode_find_their_coordinate(one_rank):
    """FSDP2 concatenates the dp and tp meshes for each DTensor parameter; under FakeTensorMode
    the new mesh's coordinate (a nonzero) fails unless computed outside it."""
    from torch._subclasses.fake_tensor import DynamicOutputShapeException, FakeTensorMode
    from torch.distributed.device_mesh import DeviceMesh

    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
    with FakeTensorMode(allow_non_fake_inputs=True):
        with pytest.raises(DynamicOutputShapeException):
            DeviceMesh._concatenate([mesh["dp"], mesh["tp"]])
        with torch_compat.device_meshes_under_fake_mode():
            both = DeviceMesh._concatenate([mesh["dp"], mesh["tp"]])
    assert tuple(both.get_coordinate()) == (0, 0)


def test_dcp_metadata_path_is_where_dcp_wrote_it(tmp_path: Path):
    dcp.save({"w": torch.ones(2)}, checkpoint_id=tmp_path)
    path = torch_compat.dcp_metadata_path(FileSystemReader(tmp_path), None)
    assert Path(path) == tmp_path / ".metadata" and Path(path).is_file()


def test_set_nested_element_builds_the_nested_dict():
    root: dict = {"a": {"b": 1}}
    torch_compat.set_nested_element(root, ("a", "c"), 2)
    torch_compat.set_nested_element(root, ("x", "y"), 3)
    assert root == {"a": {"b": 1, "c": 2}, "x": {"y": 3}}


def test_fsspec_reader_and_writer_round_trip(tmp_path: Path):
    url = f"file://{tmp_path}/ckpt"
    dcp.save({"w": torch.arange(4.0)}, storage_writer=torch_compat.FsspecWriter(url))
    loaded = {"w": torch.zeros(4)}
    dcp.load(loaded, storage_reader=torch_compat.FsspecReader(url))
    assert torch.equal(loaded["w"], torch.arange(4.0))


def test_checkpoint_wrapper_keeps_state_dict_keys_and_values():
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4))
    keys = list(block.state_dict())
    x = torch.randn(3, 4, requires_grad=True)
    want = block(x)
    want.sum().backward()
    grads = [p.grad.clone() for p in block.parameters()]
    block.zero_grad()
    wrapped = torch_compat.checkpoint_wrapper(block, preserve_rng_state=False)
    got = wrapped(x)
    got.sum().backward()
    assert list(wrapped.state_dict()) == keys  # checkpoints keep their keys
    assert torch.equal(got, want)
    assert all(torch.equal(p.grad, g) for p, g in zip(block.parameters(), grads, strict=True))


def test_canonical_name_removes_what_wrappers_add():
    block = nn.Sequential(nn.Linear(4, 4))
    wrapped = torch.compile(torch_compat.checkpoint_wrapper(block, preserve_rng_state=False))
    names = [torch_compat.canonical_name(name) for name, _ in wrapped.named_parameters()]
    assert names == [name for name, _ in block.named_parameters()]


def test_is_zero_redundancy_optimizer(one_rank):
    from torch.distributed.optim import ZeroRedundancyOptimizer

    params = [nn.Parameter(torch.ones(2))]
    assert not torch_compat.is_zero_redundancy_optimizer(torch.optim.AdamW(params))
    zero = ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW)
    assert torch_compat.is_zero_redundancy_optimizer(zero)


def test_is_fake_tells_a_fake_tensor_from_a_real_one():
    from torch._subclasses.fake_tensor import FakeTensorMode

    assert not torch_compat.is_fake(torch.ones(2))
    with FakeTensorMode():
        assert torch_compat.is_fake(torch.ones(2))


def test_nothing_imports_the_zero_module_or_dcp_fsspec_early():
    """The adapter keeps its slow imports for first use (a fresh interpreter)."""
    code = (
        "import sys, distrain.torch_compat, distrain.parallel.mesh\n"
        "print(sorted(m for m in ('torch.distributed.optim.zero_redundancy_optimizer',"
        " 'torch.distributed.checkpoint._fsspec_filesystem') if m in sys.modules))"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# --- differences between the supported torch releases (each test passes on 2.11, 2.13, 2.14) ---


def test_ddp_without_forward_buffer_sync_is_accepted_without_a_warning(one_rank):
    import warnings

    from torch.nn.parallel import DistributedDataParallel

    kwargs = torch_compat.ddp_without_forward_buffer_sync()
    model = nn.Linear(2, 2)
    model.register_buffer("table", torch.ones(2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # 2.13's deprecation of broadcast_buffers is an error
        ddp = DistributedDataParallel(model, **kwargs)
    (name,) = kwargs
    assert getattr(ddp, name) is False
    ddp(torch.ones(1, 2)).sum().backward()


def test_torchrun_shutdown_timeout_is_an_option_this_torchrun_takes():
    from torch.distributed.run import get_args_parser

    extra = torch_compat.torchrun_shutdown_timeout(35)
    args = get_args_parser().parse_args([*extra, "--standalone", "-m", "distrain.train"])
    if extra:
        assert args.shutdown_timeout == 35
    else:  # torch 2.11: no such option, the agent's 30 s are fixed
        assert torch_compat.torch_release() < (2, 13)


def test_default_stager_stages_again_and_again():
    from torch.distributed.checkpoint.staging import StagingOptions

    stager = torch_compat.DefaultStager(
        StagingOptions(
            use_pinned_memory=False,
            use_shared_memory=False,
            use_async_staging=False,
            use_non_blocking_copy=False,
        )
    )
    try:
        for value in (1.0, 2.0, 3.0):
            source = {"model": {"w": torch.full((4, 4), value)}, "step": torch.tensor(int(value))}
            staged = stager.stage(source)
            source["model"]["w"].zero_()  # the step may overwrite it once staged
            assert torch.equal(staged["model"]["w"], torch.full((4, 4), value))
            assert int(staged["step"]) == int(value)
    finally:
        stager.close()


def test_all_gather_single_and_reduce_scatter_single(one_rank):
    x = torch.arange(6.0).reshape(2, 3)
    out = torch.empty(2, 3)
    torch_compat.all_gather_single(out, x)
    assert torch.equal(out, x)
    back = torch.empty(2, 3)
    torch_compat.reduce_scatter_single(back, out)
    assert torch.equal(back, x)
