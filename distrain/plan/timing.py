"""Step-time model of one layout on a cluster: compute, communication, pipeline bubble, overlap.

- compute: training FLOPs of the rank's share of the global batch (6 per weight per token plus
  attention, `flops_per_token`) / (peak x efficiency); activation checkpointing adds a forward
  (x 4/3);
- communication: the bytes each collective moves per rank (ring: all-reduce 2 (n-1)/n x size,
  all-gather and reduce-scatter (n-1)/n) / the bandwidth of the link it crosses: tensor parallel
  stays inside a node; data parallel crosses nodes as soon as its group spans more than one;
  pipeline sends one activation per micro-batch per stage boundary;
- overlap: data-parallel gradient communication hides behind backward (2/3 of compute) and FSDP's
  forward all-gather behind forward; tensor-parallel collectives sit on the critical path;
- bubble: (pp - 1) / (micro-batches + pp - 1) of the pipelined time (1F1B/GPipe; interleaved
  divides it by the stages per rank).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from distrain.family.spec import FamilyModel


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

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard


@dataclass(frozen=True)
class StepTime:
    compute_s: float
    tp_comm_s: float
    dp_comm_s: float
    pp_comm_s: float
    exposed_comm_s: float
    bubble_s: float
    step_s: float
    tokens_per_s: float
    mfu: float

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


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
    intra_node = c.tp * c.dp <= cluster.gpus_per_node or c.dp == 1
    # tp: 2 all-reduces per block forward (attention out, MLP out), 2 in backward, of the
    # activations [b, s, d] of every micro-batch (reduce-scatter + all-gather under SP: the same
    # bytes).
    local_tokens = tokens // c.dp
    tp_bytes = 4 * shape.n_layers // c.pp * local_tokens * shape.dim * bytes_per_value
    tp_comm = 2 * _ring(c.tp) * tp_bytes / cluster.intra_bw
    # dp: gradients of this rank's share of the model, once per step (fp32 reduce).
    shard = model.num_params() / (c.tp * c.pp)
    dp_bw = cluster.intra_bw if c.tp * c.dp <= cluster.gpus_per_node else cluster.inter_bw
    if c.zero_stage >= 2:
        # reduce-scatter of fp32 grads + all-gather of params (twice under ZeRO-3).
        gathers = 2 if c.zero_stage == 3 else 1
        dp_bytes = _ring(c.dp) * shard * (4 + gathers * bytes_per_value)
    else:
        dp_bytes = 2 * _ring(c.dp) * shard * 4
    dp_comm = dp_bytes / dp_bw
    # pp: one activation per micro-batch per boundary, forward and backward; across nodes when
    # the stages do not fit one node.
    microbatches = max(1, global_batch // (c.dp * c.micro_batch_size))
    pp_bw = (
        cluster.intra_bw
        if intra_node and c.pp * c.tp * c.dp <= cluster.gpus_per_node
        else (cluster.inter_bw)
    )
    pp_bytes = 2 * microbatches * c.micro_batch_size * seq_len * shape.dim * bytes_per_value
    pp_comm = pp_bytes / pp_bw if c.pp > 1 else 0.0
    exposed = tp_comm + max(0.0, dp_comm - compute * 2 / 3) + pp_comm / max(1, microbatches)
    work = compute + exposed
    stages_per_rank = 2 if c.pp_schedule in ("interleaved_1f1b", "zero_bubble") else 1
    bubble = work * (c.pp - 1) / (microbatches * stages_per_rank + c.pp - 1) if c.pp > 1 else 0.0
    step = work + bubble
    return StepTime(
        compute_s=compute,
        tp_comm_s=tp_comm,
        dp_comm_s=dp_comm,
        pp_comm_s=pp_comm,
        exposed_comm_s=exposed,
        bubble_s=bubble,
        step_s=step,
        tokens_per_s=tokens / step,
        mfu=flops_tok * tokens / step / (cluster.world_size * cluster.peak_flops),
    )
