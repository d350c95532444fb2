"""The device mesh: `ParallelDims` turns the `[parallel]` config and the world size into named
axis degrees and builds the DeviceMesh (and the expert-parallel mesh); whether the degrees fit
the world size is one of layout/rules.py's rules, checked before this module sees them.
`node_groups` makes the groups of the hierarchical all-reduce, `embedding_group` that of a
tied embedding split across pipeline stages and `site_group` that of a DiLoCo site.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from distrain.config.schema import ParallelConfig
from distrain.parallel.device import collective_timeout, group_options
from distrain.torch_compat import flatten_mesh, flattened_submesh

AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
DP_CP = ("dp_replicate", "dp_shard", "cp")


def data_parallel_size(p: ParallelConfig, world_size: int) -> int:
    """The data-parallel size: the ranks left once context, tensor and pipeline parallelism took
    theirs (world // (cp x tp x pp); the layout rules check that it divides)."""
    return world_size // (p.cp * p.tp * p.pp)


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of each parallel axis; their product is the world size.

    Mesh axes, outermost first: pp, dp_replicate, dp_shard, cp, tp. Tensor parallelism is
    innermost so its chatty collectives stay on the fastest links (one node); context parallelism
    (each layer's key/value all-gather) next to it; pipeline is outermost since it sends the
    least. `dp` (dp_replicate x dp_shard) is the data-parallel group the loader splits the global
    batch over; the cp ranks of a dp rank read the same sequences and split each of them, and
    gradients are averaged over dp x cp. `ep` is not a further factor of the world size: it
    regroups the dp ranks for the expert weights (`build_ep_mesh`).
    """

    pp: int
    dp_replicate: int
    dp_shard: int
    tp: int
    zero_stage: int
    world_size: int
    dp_wrapper: str
    """How the model is wrapped for data parallelism: "none" when there is one replica,
    "fsdp" (FSDP2) for ZeRO 2/3 and also for plain replication whenever tp or pp is on (HSDP
    with a shard axis of 1, since DDP handles neither DTensor parameters nor pipeline stages
    correctly) and under ep (expert weights live on their own mesh), else "ddp". The cp ranks
    of a data-parallel rank count as replicas here: each computes its share of the gradient,
    which the wrapper averages over dp x cp. "optimizer": no wrapper, the optimizer averages
    the gradients itself (its capability says so: optim/capability.py)."""
    ep: int = 1
    cp: int = 1
    diloco: bool = False
    """DiLoCo (diloco.inner_steps > 0): each dp_replicate group is a site that trains on its
    own between outer steps, so FSDP2 reduces over the site's dp_shard (x cp) ranks only
    (`fsdp_mesh`) and the outer step averages over dp_replicate."""

    @classmethod
    def from_config(
        cls, p: ParallelConfig, world_size: int, *, optimizer_averages: bool, diloco: bool = False
    ) -> ParallelDims:
        """The degrees `cfg` gives `world_size` ranks, -1 standing for what is left over
        (layout/rules.py's validate has checked that they fit). `optimizer_averages`: the optimizer
        averages the data-parallel gradients itself (`OptimizerCapability.replaces_wrapper`),
        so no wrapper shards the parameters: they are whole on every dp rank. `diloco`: the
        dp_replicate groups are DiLoCo sites (`ParallelDims.diloco`)."""
        dp = data_parallel_size(p, world_size)
        replicate, shard = p.dp_replicate, p.dp_shard
        if p.zero_stage <= 1 or optimizer_averages:  # the parameters are whole on every dp rank
            replicate, shard = dp, 1
        elif shard == -1:
            replicate = 1 if replicate == -1 else replicate
            shard = dp // replicate
        elif replicate == -1:
            replicate = dp // shard
        if replicate * shard * p.cp == 1:
            wrapper = "none"
        elif optimizer_averages:
            wrapper = "optimizer"
        elif p.zero_stage >= 2 or p.tp > 1 or p.pp > 1 or p.ep > 1:
            wrapper = "fsdp"
        else:
            wrapper = "ddp"
        return cls(
            pp=p.pp,
            dp_replicate=replicate,
            dp_shard=shard,
            tp=p.tp,
            zero_stage=p.zero_stage,
            world_size=world_size,
            dp_wrapper=wrapper,
            ep=p.ep,
            cp=p.cp,
            diloco=diloco,
        )

    @property
    def dp_size(self) -> int:
        return self.dp_replicate * self.dp_shard

    def describe(self) -> str:
        return (
            f"pp={self.pp} dp_replicate={self.dp_replicate} dp_shard={self.dp_shard} tp={self.tp} "
            f"zero_stage={self.zero_stage}"
            + (f" ep={self.ep}" if self.ep > 1 else "")
            + (f" cp={self.cp}" if self.cp > 1 else "")
            + (" diloco" if self.diloco else "")
        )

    @staticmethod
    def sites_in(layout: str) -> int | None:
        """The number of DiLoCo sites of a layout `describe` wrote (a checkpoint manifest's),
        None for a layout without DiLoCo."""
        found = re.search(r"\bdp_replicate=(\d+)\b", layout)
        return int(found.group(1)) if found and layout.endswith(" diloco") else None

    def build_mesh(
        self, device_type: str, *, timeout_s: float = 0.0
    ) -> tuple[DeviceMesh, DeviceMesh]:
        """The world mesh with every axis (size-1 axes included, so names never go missing), and
        the 1-D data-parallel mesh (dp_replicate x dp_shard flattened) the loader splits over.
        `timeout_s` (comm.collective_timeout_s) goes to every group the mesh creates."""
        options = group_options(dist.get_backend(), timeout_s)
        mesh = init_device_mesh(
            device_type,
            (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp),
            mesh_dim_names=AXES,
            backend_override=dict.fromkeys(AXES, options) if options else None,
        )
        if self.cp > 1:
            for axes, name in ((("dp_shard", "cp"), "dp_shard_cp"), (DP_CP, "dp_cp")):
                flatten_mesh(mesh[axes], name, backend_override=options)
        return mesh, flatten_mesh(mesh["dp_replicate", "dp_shard"], "dp", backend_override=options)

    def gradient_mesh(self, mesh: DeviceMesh, dp_mesh: DeviceMesh) -> DeviceMesh:
        """The 1-D mesh DDP averages gradients over: `dp_mesh`, or dp x cp under context
        parallelism (flattened by `build_mesh`)."""
        return dp_mesh if self.cp == 1 else flattened_submesh(mesh, "dp_cp")

    def zero1_mesh(self, mesh: DeviceMesh, dp_mesh: DeviceMesh) -> DeviceMesh:
        """The 1-D mesh ZeRO-1 shards the optimizer state over: the ranks holding the same
        parameters, which are the gradient mesh's under DDP (dp x cp under context parallelism)
        and `dp_mesh` under FSDP2 (tp, pp), which shards over cp itself."""
        return self.gradient_mesh(mesh, dp_mesh) if self.dp_wrapper == "ddp" else dp_mesh

    def fsdp_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        """The mesh FSDP2 shards over: dp_shard (with dp_replicate for HSDP, but not between
        DiLoCo sites); under context parallelism the cp axis joins the shard axis (dp_shard x
        cp, flattened by `build_mesh`), so gradients are averaged over the cp ranks too, as
        torchtitan does."""
        shard = "dp_shard" if self.cp == 1 else "dp_shard_cp"
        hsdp = self.dp_replicate > 1 and not self.diloco
        return flattened_submesh(mesh, ("dp_replicate", shard) if hsdp else shard)

    def build_ep_mesh(self, device_type: str, *, timeout_s: float = 0.0) -> DeviceMesh:
        """The expert-parallel mesh, axes pp, dp_mod_ep, ep, tp (size-1 axes kept).

        EP ranks come out of the data-parallel ranks, as in torchtitan: the ep ranks of a group
        are `ep` consecutive data-parallel indices (dp_shard first, then dp_replicate), so a group
        stays on one node as long as it fits. Expert weights are split over `ep` and
        FSDP-sharded over `dp_mod_ep`, the data-parallel ranks EP does not use. A separate root
        mesh from `build_mesh`'s (the same ranks, grouped differently); both pass the same
        `timeout_s` to their groups.
        """
        options = group_options(dist.get_backend(), timeout_s)
        names = ("pp", "dp_mod_ep", "ep", "tp")
        return init_device_mesh(
            device_type,
            (self.pp, self.dp_size // self.ep, self.ep, self.tp),
            mesh_dim_names=names,
            backend_override=dict.fromkeys(names, options) if options else None,
        )


def embedding_group(mesh: DeviceMesh, *, timeout_s: float = 0.0) -> dist.ProcessGroup | None:
    """The group of this rank's first and last pipeline rank (same dp and tp coordinates): the
    two holders of a tied embedding, whose gradients they sum (as Megatron's embedding group).
    None without a pipeline. With pp = 2 it is the pp axis itself; else every rank creates every
    pair's group, in the same order, as `new_group` requires. Collective."""
    pp = mesh.size(0)
    if pp == 1:
        return None
    if pp == 2:
        return mesh["pp"].get_group()
    ranks = mesh.mesh.reshape(pp, -1)
    me = dist.get_rank()
    mine = None
    for column in range(ranks.shape[1]):
        members = [int(ranks[0, column]), int(ranks[pp - 1, column])]
        group = dist.new_group(members, timeout=collective_timeout(timeout_s))
        if me in members:
            mine = group
    return mine


def site_group(mesh: DeviceMesh, *, timeout_s: float = 0.0) -> dist.ProcessGroup:
    """The ranks of this rank's DiLoCo site: every rank of its dp_replicate index (all pp,
    dp_shard, cp and tp coordinates). Every rank creates every site's group, in the same order,
    as `new_group` requires. Collective."""
    ranks = mesh.mesh.transpose(0, 1).reshape(mesh.size(1), -1)
    me = dist.get_rank()
    mine = None
    for row in ranks:
        members = [int(r) for r in row]
        group = dist.new_group(members, timeout=collective_timeout(timeout_s))
        if me in members:
            mine = group
    assert mine is not None
    return mine


def node_groups(
    local_world_size: int, dp_ranks: list[int], *, timeout_s: float = 0.0
) -> tuple[dist.ProcessGroup, dist.ProcessGroup | None]:
    """Groups for a topology-aware all-reduce over the data-parallel ranks `dp_ranks`: this
    rank's node (ranks sharing rank // local_world_size) and, on each node's first rank, the
    group of those first ranks. Every rank creates every group, in the same order, as
    `new_group` requires."""
    by_node: dict[int, list[int]] = {}
    for r in dp_ranks:
        by_node.setdefault(r // local_world_size, []).append(r)
    me = dist.get_rank()
    intra = None
    for members in by_node.values():
        group = dist.new_group(members, timeout=collective_timeout(timeout_s))
        if me in members:
            intra = group
    leaders = [members[0] for members in by_node.values()]
    inter = dist.new_group(leaders, timeout=collective_timeout(timeout_s))
    return intra, inter if me in leaders else None
