"""Step-time model of one layout on a cluster: compute, communication, pipeline bubble, overlap.

- compute: training FLOPs of the rank's share of the global batch (6 per weight per token plus
  attention, `flops_per_token`) / (peak x efficiency); activation checkpointing adds a forward
  (x 4/3);
- communication: the bytes each collective moves per rank (ring: all-reduce 2 (n-1)/n x size,
  all-gather and reduce-scatter (n-1)/n) / the bandwidth of the link it crosses: tensor parallel
  stays inside a node; data parallel crosses nodes as soon as its group spans more than one;
  pipeline sends one activation per micro-batch per stage boundary; context parallelism passes
  each block's keys and values round its ranks; expert parallelism sends each token's top_k
  copies to their experts and back (all-to-all), priced for a balanced router; replica groups
  all-reduce each rank's gradient shard over the groups after backward;
- overlap: data-parallel gradient communication hides behind backward (BACKWARD_SHARE of the
  compute) as far as the device lets a collective progress while it computes (the cluster's
  concurrency: 1 on GPUs, measured by `distrain plan --calibrate` for ranks like this machine's)
  and FSDP's forward all-gather behind forward; tensor-, context- and expert-parallel exchanges and
  the replica groups' all-reduce sit on the critical path;
- bubble: (pp - 1) / (micro-batches + pp - 1) of the pipelined time (1F1B/GPipe; interleaved
  divides it by the stages per rank).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from distrain.family.spec import FamilyModel

BACKWARD_SHARE = 2 / 3
"""The share of a step's compute that is backward, behind which the gradients' communication
can hide (2 of the 3 matmuls per weight)."""


@dataclass(frozen=True)
class Cluster:
    """What a plan is for: ranks, per-device memory and speed, link bandwidths (bytes/s)."""

    nodes: int
    gpus_per_node: int
    memory_bytes: float
    peak_flops: float
    efficiency: float
    intra_bw: float
    inter_bw: float
    concurrency: float = 1.0
    """The share of a collective that progresses while its rank computes: 1 on GPUs (NCCL's
    kernels on their own stream); on CPU ranks gloo's threads compete with the compute for the
    cores (collectives.py's `time_concurrency`)."""

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True)
class Candidate:
    """One layout of the search (parallel degrees, ZeRO, checkpointing, micro-batch)."""

    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    zero_stage: int
    activation_checkpointing: str
    micro_batch_size: int
    pp_schedule: str = "1f1b"
    cp: int = 1
    ep: int = 1
    groups: int = 0
    """Replica groups (fault_tolerance.replica_groups), each its own torchrun, that
    dp_replicate counts; 0: none."""

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard


@dataclass(frozen=True)
class StepTime:
    compute_s: float
    tp_comm_s: float
    dp_comm_s: float
    pp_comm_s: float
    cp_comm_s: float
    ep_comm_s: float
    groups_comm_s: float
    exposed_comm_s: float
    bubble_s: float
    step_s: float
    tokens_per_s: float
    mfu: float

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def hidden_s(compute_s: float, concurrency: float) -> float:
    """How much data-parallel gradient communication a step computing for `compute_s` hides."""
    return BACKWARD_SHARE * concurrency * compute_s


def _ring(n: int) -> float:
    return (n - 1) / n if n > 1 else 0.0


def step_time(
    c: Candidate,
    model: FamilyModel,
    cluster: Cluster,
    *,
    global_batch: int,
    seq_len: int,
    bytes_per_value: int,
) -> StepTime:
    """Predicted seconds per optimizer step of candidate `c` (see the module docstring)."""
    flops_tok = model.flops_per_token(seq_len)
    shape = model.shape
    tokens = global_batch * seq_len
    recompute = 4 / 3 if c.activation_checkpointing == "full" else 1.0
    rank_flops = flops_tok * tokens * recompute / cluster.world_size
    compute = rank_flops / (cluster.peak_flops * cluster.efficiency)
    intra_node = c.tp * c.cp * c.dp <= cluster.gpus_per_node or c.dp == 1
    # tp: 2 all-reduces per block forward (attention out, MLP out), 2 in backward, of the
    # activations [b, s, d] of every micro-batch (reduce-scatter + all-gather under SP: the same
    # bytes); a cp rank holds 1/cp of each sequence.
    local_tokens = tokens // (c.dp * c.cp)
    blocks = shape.n_layers // c.pp
    tp_bytes = 4 * blocks * local_tokens * shape.dim * bytes_per_value
    tp_comm = 2 * _ring(c.tp) * tp_bytes / cluster.intra_bw
    # cp: each block's keys and values of the rank's chunk go round the cp ranks in forward
    # (ring: cp - 1 hops; allgather: the same bytes), and back with their gradients in backward
    # (twice the bytes); checkpointing repeats the forward's. Next to tp in the mesh: inside a
    # node while tp x cp fits one.
    kv_bytes = 2 * blocks * local_tokens * shape.kv_width * bytes_per_value
    passes = 3 + (c.activation_checkpointing == "full")
    cp_bw = cluster.intra_bw if c.tp * c.cp <= cluster.gpus_per_node else cluster.inter_bw
    cp_comm = passes * (c.cp - 1) * kv_bytes / cp_bw
    # ep: every MoE layer sends each token's top_k copies to their experts' ranks and back, in
    # forward and again in backward; (ep - 1) / ep of them leave the rank. An ep group is ep
    # consecutive data-parallel ranks: inside a node while tp x ep fits one.
    moe_layers = len(shape.moe_layers) // c.pp
    a2a_bytes = 4 * moe_layers * local_tokens * shape.top_k * shape.dim * bytes_per_value
    ep_bw = cluster.intra_bw if c.tp * c.ep <= cluster.gpus_per_node else cluster.inter_bw
    ep_comm = _ring(c.ep) * a2a_bytes / ep_bw
    # dp: gradients of this rank's share of the model, once per step (fp32 reduce), averaged
    # over dp x cp; the routed experts (split over ep, not over tp) over the dp / ep ranks
    # holding the same experts.
    experts = shape.expert_params / (c.pp * c.ep)
    dense = (model.num_params() - shape.expert_params) / (c.tp * c.pp)
    # Replica groups: the gradients are reduced inside a group (its dp_shard ranks), then each
    # rank's fp32 shard is all-reduced over the groups after backward (torchft), exposed.
    group = c.dp_shard if c.groups else c.dp
    dp_bw = cluster.intra_bw if c.tp * c.cp * group <= cluster.gpus_per_node else cluster.inter_bw
    if c.zero_stage >= 2:
        # reduce-scatter of fp32 grads + all-gather of params (twice under ZeRO-3).
        gathers = 2 if c.zero_stage == 3 else 1
        per_value = 4 + gathers * bytes_per_value
    else:
        per_value = 2 * 4
    dp_bytes = (_ring(group * c.cp) * dense + _ring(group // c.ep) * experts) * per_value
    dp_comm = dp_bytes / dp_bw
    one_node = cluster.world_size <= cluster.gpus_per_node
    groups_bw = cluster.intra_bw if one_node else cluster.inter_bw
    shard_bytes = 4 * dense / (group * c.cp)
    groups_comm = 2 * _ring(c.groups) * shard_bytes / groups_bw if c.groups else 0.0
    # pp: one activation per micro-batch per boundary, forward and backward; across nodes when
    # the stages do not fit one node.
    microbatches = max(1, global_batch // (c.dp * c.micro_batch_size))
    pp_bw = (
        cluster.intra_bw
        if intra_node and c.pp * c.tp * c.cp * c.dp <= cluster.gpus_per_node
        else (cluster.inter_bw)
    )
    pp_bytes = 2 * microbatches * c.micro_batch_size * seq_len * shape.dim * bytes_per_value
    pp_comm = pp_bytes / pp_bw if c.pp > 1 else 0.0
    exposed = tp_comm + cp_comm + ep_comm + groups_comm
    exposed += max(0.0, dp_comm - hidden_s(compute, cluster.concurrency))
    exposed += pp_comm / max(1, microbatches)
    work = compute + exposed
    stages_per_rank = 2 if c.pp_schedule in ("interleaved_1f1b", "zero_bubble") else 1
    bubble = work * (c.pp - 1) / (microbatches * stages_per_rank + c.pp - 1) if c.pp > 1 else 0.0
    step = work + bubble
    return StepTime(
        compute_s=compute,
        tp_comm_s=tp_comm,
        dp_comm_s=dp_comm,
        pp_comm_s=pp_comm,
        cp_comm_s=cp_comm,
        ep_comm_s=ep_comm,
        groups_comm_s=groups_comm,
        exposed_comm_s=exposed,
        bubble_s=bubble,
        step_s=step,
        tokens_per_s=tokens / step,
        mfu=flops_tok * tokens / step / (cluster.world_size * cluster.peak_flops),
    )
