"""The run configuration's schema: typed dataclasses per component, a help text per field, and
the range of every number (a `Range` in each numeric field's metadata: the rule table of values),
and the checks between fields that need neither the world size nor the model (layout/rules.py has
those). The `[debug]` section's schema lives in debug.py.

A config is resolved in three layers (see io.py): the dataclass defaults, then a TOML file
(`--config`), then dotted command-line overrides (`--training.steps 200`).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from distrain.config.debug import DebugConfig
from distrain.config.ranges import (
    AT_LEAST_0,
    AT_LEAST_1,
    AUTO_OR_AT_LEAST_1,
    BETA,
    FRACTION,
    POSITIVE,
    Range,
    doc,
)
from distrain.errors import ConfigError


@dataclass(kw_only=True, slots=True)
class RunConfig:
    dir: str = doc(
        "runs/default", "Run directory: config.toml, metrics.jsonl, logs/, tb/, checkpoints/."
    )
    resume: bool = doc(
        False,
        "Require a complete checkpoint in the run directory and continue from it (resume is "
        "automatic whenever one exists; this flag makes its absence an error).",
    )
    device: Literal["auto", "cpu", "cuda"] = doc(
        "auto", "Device type: auto picks cuda (NCCL) when CUDA is present, else cpu (gloo)."
    )


@dataclass(kw_only=True, slots=True)
class MoEConfig:
    """Mixture of experts; every field None = the preset's value (dense presets: 0 experts)."""

    num_experts: int | None = doc(
        None, "Routed experts per MoE layer (0 = a dense model).", AT_LEAST_0
    )
    top_k: int | None = doc(
        None, "Experts per token (1 = Switch; > 1 renormalises the k gates).", AT_LEAST_1
    )
    every: int | None = doc(
        None,
        "An MoE layer in every k-th block (block i when (i + 1) % k == 0), dense MLPs in "
        "the others.",
        AT_LEAST_1,
    )
    shared_experts: int | None = doc(
        None,
        "Always-on experts per MoE layer, as one dense MLP of that many expert widths "
        "(DeepSeek-MoE).",
        AT_LEAST_0,
    )
    ffn_dim: int | None = doc(None, "Hidden size of one expert (0 = model.ffn_dim).", AT_LEAST_0)
    capacity_factor: float | None = doc(
        None,
        "0 = dropless; > 0: each expert takes at most ceil(factor x top_k x tokens / experts) "
        "token copies of each micro-batch, the rest pass through the residual (Switch).",
        AT_LEAST_0,
    )
    aux_loss_coef: float | None = doc(
        None,
        "Weight of Switch's load-balancing loss E x sum_i f_i P_i (with balance = 'aux').",
        AT_LEAST_0,
    )
    z_loss_coef: float | None = doc(
        None, "Weight of the router z-loss, mean squared logsumexp of router logits.", AT_LEAST_0
    )
    balance: Literal["aux", "bias", "none"] | None = doc(
        None,
        "Load balancing: aux = the auxiliary loss; bias = DeepSeek-V3's per-expert routing bias, "
        "moved by moe.bias_update_rate after each step against the load summed over "
        "data-parallel ranks (kept in checkpoints); none = neither.",
    )
    bias_update_rate: float | None = doc(
        None, "Step of the per-expert bias update (balance = 'bias').", AT_LEAST_0
    )


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    family: str = doc(
        "",
        "The model family: its folder under distrain/models/ or one a plugin registers "
        "(`distrain presets` lists them with their presets). Empty = the family of "
        "model.preset (gpt for the default preset, tiny); one that does not hold the preset is "
        "refused. The fields below apply to the families that read them; setting one the "
        "family does not read is refused.",
    )
    preset: str = doc("tiny", "Named model preset of the family (see `distrain presets`).")
    vocab_size: int | None = doc(None, "Override the preset's vocabulary size.", AT_LEAST_1)
    dim: int | None = doc(None, "Override the preset's hidden size.", AT_LEAST_1)
    n_layers: int | None = doc(
        None, "Override the preset's number of transformer blocks.", AT_LEAST_1
    )
    n_heads: int | None = doc(None, "Override the preset's number of attention heads.", AT_LEAST_1)
    ffn_dim: int | None = doc(None, "Override the preset's MLP hidden size.", AT_LEAST_1)
    max_seq_len: int | None = doc(
        None,
        "Override the preset's longest sequence (training.seq_len may not exceed it; learned "
        "positions add max_seq_len x dim parameters).",
        AT_LEAST_1,
    )
    norm: Literal["rmsnorm", "layernorm"] | None = doc(None, "Override the preset's norm type.")
    pos_emb: Literal["rope", "learned"] | None = doc(None, "Override the position encoding.")
    tie_embeddings: bool | None = doc(
        None, "Override whether output and input embeddings share weights."
    )
    n_kv_heads: int | None = doc(
        None,
        "Override the preset's key/value heads (grouped-query attention; must divide n_heads; "
        "under tensor parallelism parallel.tp must divide it).",
        AT_LEAST_1,
    )
    mlp: Literal["gelu", "swiglu"] | None = doc(
        None, "Override the MLP: gelu (GPT-2) or swiglu (Llama, gated: a third weight)."
    )
    bias: bool | None = doc(None, "Override whether linears and LayerNorms have biases (GPT-2).")
    head_dim: int | None = doc(
        None,
        "Override the width of each attention head (qwen3; the other families' heads are dim / "
        "n_heads wide).",
        AT_LEAST_1,
    )
    rope_theta: float | None = doc(None, "Override the rotary base frequency.", POSITIVE)
    rope_scaling_factor: float | None = doc(
        None,
        "Override Llama 3's rotary frequency scaling factor (1 = none).",
        Range(low=1),
    )
    init_from: str = doc(
        "",
        "Start from pretrained weights: 'hf:DIR', a local Hugging Face checkpoint (config.json + "
        "safetensors) of the family's model (llama, gpt2, qwen3, mixtral); its config.json sets "
        "the model shape (the preset is ignored). Empty: seeded random init.",
    )
    moe: MoEConfig = field(default_factory=MoEConfig)


@dataclass(kw_only=True, slots=True)
class LoRAConfig:
    """LoRA fine-tuning (parallel/lora.py): rank 0 (the default) trains every weight."""

    rank: int = doc(
        0,
        "Rank r of the low-rank adapters; 0 = off (full fine-tuning). > 0: the base weights "
        "are frozen and only the adapters train (the optimizer and the checkpoint hold only "
        "them; the base comes from model.init_from, or the seed, at each start).",
        AT_LEAST_0,
    )
    alpha: float = doc(
        16.0, "LoRA alpha: the adapter's output is scaled by alpha / rank.", POSITIVE
    )
    dropout: float = doc(
        0.0, "Dropout on the adapters' input (0 = none; peft's lora_dropout).", BETA
    )
    target_modules: str = doc(
        "q_proj,v_proj",
        "Comma-separated linear layers to adapt, by module name or its last parts (peft's "
        "target_modules): the family's Hugging Face names (q_proj, k_proj, v_proj, o_proj, "
        "gate_proj, up_proj, down_proj) or distrain's (wq, wk, wv, wo, w_gate, w_up, w_down).",
    )


@dataclass(kw_only=True, slots=True)
class EvalSetConfig:
    """A named validation set evaluated at each validation pass besides the training data's
    own held-out split (`[[data.eval_sets]]` in TOML): read whole, with the run's tokenizer."""

    name: str = doc("", "Name in the metrics: val/NAME/loss and val/NAME/ppl.")
    path: str = doc("", "A text file, a folder of text files, or a token file (.bin / .npy).")
    format: Literal["auto", "text", "tokens"] = doc(
        "auto", "How to read path: auto decides by suffix (.bin/.npy = tokens)."
    )
    glob: str = doc("**/*", "Files to read when path is a folder.")
    max_bytes: int = doc(0, "Read at most this many bytes of text (0 = all).", AT_LEAST_0)


EVAL_SET_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


@dataclass(kw_only=True, slots=True)
class SourceConfig:
    """One source of a mixture: a `[[data.sources]]` table."""

    path: str = doc("", "A sharded dataset folder, its fsspec URL, or a token file.")
    weight: float = doc(1.0, "Its share of the samples (weights are normalised).", POSITIVE)
    name: str = doc("", "Its name in metrics and logs (default: the last part of its path).")


@dataclass(kw_only=True, slots=True)
class DataConfig:
    path: str = doc(
        "",
        "Training data: a text file, a folder of text files, a token file (.bin raw / .npy), "
        "or a sharded dataset (a folder from `distrain prepare --shard-tokens`, or its fsspec "
        "URL such as s3://bucket/prefix). Empty: the running Python's standard library source.",
    )
    sources: tuple[SourceConfig, ...] = doc(
        (),
        "A weighted mixture instead of data.path: [[data.sources]] tables with path (as "
        "data.path, but data: token files or sharded datasets made with data.tokenizer), weight "
        "(> 0, normalised) and name (for metrics data/tokens/NAME). The sample order is a "
        "function of the seed, the sample position and the weights; weights may change between "
        "runs (each source resumes where it stopped).",
    )
    cache_dir: str = doc(
        "", "Local folder for the shards of a remote (URL) dataset; required for one."
    )
    cache_bytes: int = doc(
        10 << 30,
        "The most bytes of remote shards kept in data.cache_dir (least recently used first out); "
        "must hold 2 x data.shuffle_window_shards shards.",
        AT_LEAST_1,
    )
    shuffle_window_shards: int = doc(
        4,
        "Sharded data: shards whose samples are shuffled together (each epoch shuffles the "
        "shards, then the samples within each window of this many); the next window is fetched "
        "while one is read.",
        AT_LEAST_1,
    )
    prefetch_batches: int = doc(
        2,
        "Global batches a background thread prepares ahead of the step (0 = on the step).",
        AT_LEAST_0,
    )
    format: Literal["auto", "text", "tokens"] = doc(
        "auto", "How to read data.path: auto decides by suffix (.bin/.npy = tokens)."
    )
    token_dtype: Literal["uint8", "uint16", "uint32", "int32"] = doc(
        "uint16",
        "Element type of a raw .bin token file (a file from `distrain prepare` names its own in "
        "its sidecar, DATA.bin.json).",
    )
    tokenizer: str = doc(
        "bytes",
        "bytes (UTF-8 bytes, vocab 256), hf:DIR_OR_FILE (a local tokenizer.json) or "
        "tiktoken:NAME_OR_FILE (a local NAME.tiktoken file, or a NAME in tiktoken's cache). "
        "Other than bytes, data.path must be a token file from `distrain prepare`.",
    )
    glob: str = doc("**/*", "Files to read when data.path is a folder (default corpus: **/*.py).")
    max_bytes: int = doc(0, "Read at most this many bytes of text (0 = all).", AT_LEAST_0)
    val_fraction: float = doc(
        0.05,
        "Fraction of the corpus held out for validation.",
        Range(low=0, high=1, low_open=True, high_open=True),
    )
    max_skew: float = doc(
        0.05,
        "Largest allowed relative difference between data-parallel ranks' sample counts.",
        FRACTION,
    )
    skew_action: Literal["warn", "error"] = doc("warn", "What a data-skew above max_skew does.")
    eval_sets: tuple[EvalSetConfig, ...] = doc(
        (),
        "More validation sets, each evaluated like the held-out split (the same "
        "training.eval_batches, spread over the set) at every validation pass: TOML "
        "[[data.eval_sets]] tables with name, path and optionally format, glob, max_bytes; on "
        "the command line NAME=PATH[,NAME=PATH...]. Read with data.tokenizer (a token file "
        "must be prepared with it) and data.token_dtype.",
    )
    document_masking: bool = doc(
        False,
        "Attention never crosses a document boundary inside a packed sample, and a document's "
        "first token is no target; the loss is then the mean over the global batch's targets. "
        "Boundaries: the token file's DATA.bin.docs.npy (from `distrain prepare`), else "
        "data.eos_id.",
    )
    eos_id: int | None = doc(
        None,
        "For data.document_masking on data without DATA.bin.docs.npy: the token id that ends "
        "each document (the next token starts a new one).",
        AT_LEAST_0,
    )


@dataclass(kw_only=True, slots=True)
class TrainingConfig:
    steps: int = doc(600, "Optimizer steps to train for.", AT_LEAST_1)
    global_batch_size: int = doc(
        32,
        "Sequences per optimizer step, summed over data-parallel ranks and accumulation steps.",
        AT_LEAST_1,
    )
    micro_batch_size: int | Literal["auto"] = doc(
        8,
        "Sequences per forward/backward on one rank; auto = the largest size dividing this "
        "rank's share of the global batch whose trial step fits in training.memory_budget_gb "
        "(found before the first step; accumulation keeps the global batch).",
        AT_LEAST_1,
    )
    memory_budget_gb: float | None = doc(
        None,
        "Memory a rank may use (GiB), for micro_batch_size = auto: the peak of a trial step "
        "plus Adam's state must stay within it. Required on CPU; on CUDA None = the device's "
        "memory.",
        POSITIVE,
    )
    seq_len: int = doc(128, "Tokens per sequence.", AT_LEAST_1)
    precision: Literal["fp32", "bf16", "fp16", "auto"] = doc(
        "fp32",
        "Compute precision: bf16 by autocast; fp16 by autocast with loss scaling; auto = bf16 "
        "where the device has native bf16 matmuls (CUDA with bf16, a CPU with AMX or "
        "AVX-512 BF16), else fp32.",
    )
    seed: int = doc(
        1234, "Seed for model init, data order and all RNGs.", Range(low=0, high=2**32 - 1)
    )
    deterministic: bool = doc(False, "Use deterministic algorithms only (slower on GPU).")
    activation_checkpointing: Literal["none", "full", "selective", "selective_op"] = doc(
        "none",
        "Recompute activations in backward: full = whole blocks; selective = every "
        "training.ac_every_layers-th block; selective_op = every block, saving the outputs of "
        "matmuls, attention and collectives and recomputing the cheap ops between them.",
    )
    ac_every_layers: int = doc(
        2,
        "With selective activation checkpointing, checkpoint every k-th block.",
        AT_LEAST_1,
    )
    compile: bool | Literal["auto"] = doc(
        "auto",
        "torch.compile the model (the whole model on a plain or DDP layout, else each block), "
        "with a persistent compile cache under the user's cache dir; auto = compile on CUDA, "
        "eager on CPU (where it measured 1.1-1.3x per step, not worth a cold compile of minutes).",
    )
    oom_recovery: bool = doc(
        False,
        "Retry a step that runs out of memory with half the micro-batch and twice the "
        "accumulation (same global batch), under every layout. With DDP the gradients are then "
        "all-reduced after the last backward instead of overlapping it; under FSDP2, tp, pp, cp "
        "and ep the ranks agree before every micro-batch. Not with comm.gradient_compression, "
        "comm.hierarchical, 1-bit Adam, DiLoCo or fault_tolerance.replica_groups.",
    )
    log_interval_steps: int = doc(10, "Steps between metric rows and progress updates.", AT_LEAST_1)
    eval_interval_steps: int = doc(
        100, "Steps between validation passes (0 = only at the end).", AT_LEAST_0
    )
    eval_batches: int | Literal["auto"] = doc(
        "auto",
        "Global batches (training.global_batch_size sequences each) in a validation pass, spread "
        "evenly over the whole validation split (all of it, wrapping, when it holds no more): "
        "the same sequences at every pass, on every layout and world size, so validation "
        "losses compare. auto = as many as the split holds, at most 131,072 tokens (1,024 "
        "sequences of 128); the run logs the count, and val_tokens in each validation row.",
        AT_LEAST_1,
    )
    nonfinite: Literal["skip", "stop"] = doc(
        "skip",
        "On a non-finite gradient norm: skip the optimizer step on every rank and count it "
        "(metrics: nonfinite_skipped), or stop naming the step, rank and first parameter. With "
        "fp16 GradScaler's own overflow skipping applies instead.",
    )
    max_nonfinite_steps: int = doc(
        10, "Stop after this many non-finite steps in a row, even with skip.", AT_LEAST_1
    )
    loss_spike_factor: float = doc(
        3.0,
        "Metrics flag loss_spike when a logged loss exceeds this many times the running mean of "
        "the earlier logged losses.",
        Range(low=1, low_open=True),
    )


@dataclass(kw_only=True, slots=True)
class OneBitConfig:
    freeze_step: int = doc(
        100,
        "1-bit Adam: steps of ordinary Adam (fp32 gradient all-reduce) before the variance is "
        "frozen and the momentum is communicated 1-bit compressed.",
        AT_LEAST_0,
    )


@dataclass(kw_only=True, slots=True)
class OptimConfig:
    name: Literal["adamw", "onebit_adam", "sgd"] = doc(
        "adamw",
        "Optimizer: adamw, onebit_adam (Tang et al. 2021; data parallel, ZeRO 0-2; under "
        "tp/pp ZeRO 0), or sgd (plain SGD: no momentum, weight decay as AdamW's; ZeRO 0, 2, 3).",
    )
    lr: float = doc(2e-3, "Peak learning rate.", POSITIVE)
    min_lr_ratio: float = doc(
        0.1, "Final learning rate of the cosine decay, as a fraction of lr.", FRACTION
    )
    warmup_steps: int = doc(20, "Linear warmup steps.", AT_LEAST_0)
    weight_decay: float = doc(
        0.1, "AdamW weight decay (not applied to norms, biases, embeddings).", AT_LEAST_0
    )
    beta1: float = doc(0.9, "AdamW beta1.", BETA)
    beta2: float = doc(0.95, "AdamW beta2.", BETA)
    eps: float = doc(1e-8, "AdamW epsilon.", POSITIVE)
    max_grad_norm: float = doc(
        1.0, "Clip gradients to this global norm (0 = no clipping).", AT_LEAST_0
    )
    onebit: OneBitConfig = field(default_factory=OneBitConfig)


@dataclass(kw_only=True, slots=True)
class DiLoCoConfig:
    """DiLoCo (Douillard et al. 2023): each site, a parallel.dp_replicate group, takes
    inner_steps optimizer steps on its own; then the sites average their pseudo-gradients
    (global minus local weights) and an outer SGD step updates the global weights, which every
    site continues from."""

    inner_steps: int = doc(
        0,
        "Inner optimizer steps between outer steps (H; 0 = off). On: parallel.dp_replicate >= 2 "
        "sites, parallel.zero_stage 2 or 3 (FSDP2 inside a site, over parallel.dp_shard).",
        AT_LEAST_0,
    )
    outer_lr: float = doc(0.7, "Learning rate of the outer SGD step.", POSITIVE)
    outer_momentum: float = doc(0.9, "Momentum of the outer SGD step (0 = none).", BETA)
    nesterov: bool = doc(True, "Nesterov momentum in the outer step.")
    sync_dtype: Literal["fp32", "bf16"] = doc(
        "fp32",
        "Precision the pseudo-gradients are averaged in over the sites (bf16: half the bytes; "
        "the outer step and the global weights stay fp32).",
    )
    fragments: int = doc(
        1,
        "Streaming DiLoCo (Douillard et al. 2025): the parameters split into this many fragments "
        "of about equal size, in model order; fragment f's outer step runs every inner_steps "
        "steps, f * inner_steps // fragments steps after fragment 0's, so each outer step sends "
        "1/fragments of the pseudo-gradients (1 = DiLoCo's single outer step). At most "
        "inner_steps.",
        AT_LEAST_1,
    )
    overlap_steps: int = doc(
        0,
        "Inner steps a fragment's pseudo-gradient average stays in flight, overlapped with "
        "them, before its outer step is merged into the site's weights (tau; 0 = wait for it). "
        "Below inner_steps // fragments, so one fragment is in flight at a time.",
        AT_LEAST_0,
    )
    overlap_mix: float = doc(
        0.5,
        "With overlap_steps > 0: a merged fragment's weights = overlap_mix x the site's weights "
        "(trained on meanwhile) + (1 - overlap_mix) x the new global weights.",
        FRACTION,
    )


@dataclass(kw_only=True, slots=True)
class ParallelConfig:
    dp_replicate: int = doc(
        -1,
        "Data-parallel replicas (DDP, or HSDP's replicate axis); -1 = what is left over "
        "(when zero_stage <= 1).",
        AUTO_OR_AT_LEAST_1,
    )
    dp_shard: int = doc(
        -1,
        "Data-parallel shards (FSDP2, zero_stage 2/3); -1 = what is left over (1 when zero_stage "
        "<= 1).",
        AUTO_OR_AT_LEAST_1,
    )
    tp: int = doc(
        1, "Tensor-parallel degree (Megatron column/row split, heads across ranks).", AT_LEAST_1
    )
    pp: int = doc(1, "Pipeline-parallel degree (stages across ranks).", AT_LEAST_1)
    cp: int = doc(
        1,
        "Context-parallel degree: each sequence split over this many ranks (load-balanced "
        "chunks; keys and values all-gathered in attention, or passed around a ring: "
        "cp_method); composes with data and tensor parallel.",
        AT_LEAST_1,
    )
    cp_method: Literal["allgather", "ring"] = doc(
        "allgather",
        "How attention sees the other cp ranks' keys and values: allgather (each layer "
        "gathers the whole sequence's and keeps them for backward) or ring (passed from rank "
        "to rank while computing; a layer keeps 1/cp of them).",
    )
    pp_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"] = doc(
        "1f1b", "Pipeline schedule (torch.distributed.pipelining)."
    )
    pp_microbatches: int = doc(
        -1,
        "Pipeline micro-batches per step per data-parallel rank; -1 = global batch / "
        "(micro_batch_size x data-parallel size).",
        AUTO_OR_AT_LEAST_1,
    )
    pp_stages_per_rank: int = doc(
        1,
        "Pipeline stages per rank (>= 2 for the interleaved and zero-bubble schedules).",
        AT_LEAST_1,
    )
    zero_stage: int = doc(
        0,
        "ZeRO stage: 0 DDP; 1 + optimizer state sharded; 2 + gradients sharded (FSDP2, no "
        "reshard after forward); 3 + parameters sharded (FSDP2).",
        Range(low=0, high=3),
    )
    sequence_parallel: bool = doc(
        True, "With tp > 1, shard norms and the residual stream along the sequence."
    )
    ep: int = doc(
        1,
        "Expert-parallel degree: MoE experts split over this many data-parallel ranks (it "
        "divides dp_replicate x dp_shard), tokens sent to them with all-to-all; expert "
        "weights are FSDP-sharded over the remaining data-parallel ranks.",
        AT_LEAST_1,
    )


@dataclass(kw_only=True, slots=True)
class CommConfig:
    bucket_cap_mb: float = doc(25.0, "DDP gradient bucket size in MiB.", POSITIVE)
    gradient_compression: Literal["none", "fp16", "bf16", "powersgd", "onebit"] = doc(
        "none",
        "DDP gradient compression hook: fp16/bf16 casts; powersgd low-rank (with error "
        "feedback); onebit = signs + one scale per block of at most 2,048 values, with error "
        "feedback.",
    )
    powersgd_rank: int = doc(2, "PowerSGD approximation rank.", AT_LEAST_1)
    powersgd_start_step: int = doc(
        10,
        "PowerSGD: steps of uncompressed all-reduce before compression starts.",
        Range(low=2, why="DDP rebuilds its buckets after step 1"),
    )
    hierarchical: bool = doc(
        False,
        "Topology-aware all-reduce: reduce inside each node, all-reduce across one rank per "
        "node, broadcast inside the node (node size from torchrun's LOCAL_WORLD_SIZE).",
    )
    collective_timeout_s: float = doc(
        0.0,
        "Timeout of every collective, given to every process group (0 = torch's default: 30 "
        "minutes on gloo, 10 minutes on NCCL). A timed-out group is unusable: the job fails.",
        AT_LEAST_0,
    )


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    dir: str = doc(
        "",
        "Where checkpoints go: a folder or an fsspec URL (s3://bucket/run); empty = "
        "<run_dir>/checkpoints.",
    )
    interval_steps: int = doc(200, "Steps between temporary checkpoints (0 = off).", AT_LEAST_0)
    interval_minutes: float = doc(
        60.0, "Minutes between temporary checkpoints (0 = off).", AT_LEAST_0
    )
    keep_temporary: int = doc(
        2,
        "Newest temporary checkpoints kept; older ones are deleted (only this run's intact "
        "ones count, and the newest is never deleted).",
        AT_LEAST_1,
    )
    resume_from: str = doc(
        "",
        "A checkpoint folder of another run (<dir>/step-NNNNNNNN, a path or URL) to start "
        "from when this run has no checkpoint of its own; training continues at its step.",
    )
    permanent_every_steps: int = doc(
        0, "Steps between permanent checkpoints (0 = off).", AT_LEAST_0
    )
    permanent_every_minutes: float = doc(
        360.0,
        "Minutes between permanent checkpoints, never deleted by retention (0 = off).",
        AT_LEAST_0,
    )
    at_end: bool = doc(True, "Save a (permanent) checkpoint after the last step.")
    async_mode: Literal["off", "thread", "process"] = doc(
        "off",
        "thread: a save stalls training only for a copy of the state into host memory (pinned "
        "on CUDA, reused from save to save), then a writer thread writes, verifies and commits "
        "it while training goes on; at most one save in flight (the next save, a stop signal's "
        "and the end of training wait for it); a failed background save is logged and counted "
        "and the next interval tries again. process: the same, with the files serialized, "
        "hashed and written by a process of each rank's own (the copy in shared memory). "
        "off: the step waits until the save is committed.",
    )
    max_failed_saves: int = doc(
        3,
        "Stop the run (non-zero exit, newest committed checkpoint intact) after this many "
        "checkpoint saves in a row have failed (full disk, unreachable storage, ...).",
        AT_LEAST_1,
    )
    storage_retry_s: float = doc(
        120.0,
        "How long a checkpoint storage call is retried (exponential backoff) while its error "
        "may pass (connection refused, timeout, server error) before the save counts as failed "
        "(0 = no retries).",
        AT_LEAST_0,
    )
    collective_timeout_s: float = doc(
        7200.0,
        "Timeout of the checkpoint collectives (a save's planning and commit, verifying on "
        "resume): long enough to write or hash the largest checkpoint over the slowest storage.",
        POSITIVE,
    )
    preempt_grace_s: int = doc(
        120,
        "Seconds a stop signal (SIGTERM, SIGUSR1, SIGINT) leaves the run to finish its step and "
        "commit a `preempt` checkpoint before it exits (rc 75); the launcher kills workers that "
        "take longer, and `distrain slurm` asks Slurm for the signal this long before the time "
        "limit.",
        AT_LEAST_1,
    )


@dataclass(kw_only=True, slots=True)
class MLflowConfig:
    """An MLflow tracking server (or store URI) that rank 0 logs the run to."""

    tracking_uri: str = doc(
        "",
        "MLflow tracking URI (http://host:port, or a local store such as sqlite:///mlflow.db); "
        "empty = no MLflow. Params = the resolved config, metrics at each logged step, "
        "artifacts at the end (config.toml, plots, summary.json). Needs the track extra "
        '(`pip install -e ".[track]"` in a checkout).',
    )
    experiment: str = doc("distrain", "MLflow experiment the run goes to (created when missing).")
    run_name: str = doc("", "MLflow run name; empty = the run directory's name.")


@dataclass(kw_only=True, slots=True)
class WandbConfig:
    """Weights & Biases, which rank 0 logs the run to."""

    mode: Literal["disabled", "online", "offline"] = doc(
        "disabled",
        "disabled = no W&B; online = log to the W&B server (WANDB_API_KEY, WANDB_BASE_URL); "
        "offline = write the W&B run files only (upload later with `wandb sync`). Needs the "
        'track extra (`pip install -e ".[track]"` in a checkout).',
    )
    project: str = doc("distrain", "W&B project.")
    entity: str = doc("", "W&B entity (team or user); empty = the account's default.")
    dir: str = doc("", "Folder W&B writes its run files under; empty = the run directory.")
    run_name: str = doc("", "W&B run name; empty = the run directory's name.")


@dataclass(kw_only=True, slots=True)
class MetricsConfig:
    tensorboard: bool = doc(True, "Write TensorBoard event files under <run_dir>/tb/.")
    progress_bar: bool = doc(True, "Show a progress bar on rank 0.")
    tracker_queue_rows: int = doc(
        10000,
        "Metric rows an experiment tracker (MLflow, W&B) may hold while it is slow or down; "
        "past that the oldest are dropped (with a warning). Training never waits for a tracker.",
        AT_LEAST_1,
    )
    tracker_close_timeout_s: float = doc(
        30.0,
        "At the end of the run, how long rank 0 waits for the trackers to send what they "
        "hold (rows, artifacts) before it gives up on them with a warning.",
        AT_LEAST_0,
    )
    mlflow: MLflowConfig = field(default_factory=MLflowConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass(kw_only=True, slots=True)
class ProfileConfig:
    start_step: int = doc(
        0,
        "Profile (torch.profiler) from this step on (0 = off); traces go to "
        "<run_dir>/profiles/rank<N>/trace.json.",
        AT_LEAST_0,
    )
    num_steps: int = doc(3, "Steps to profile.", AT_LEAST_1)
    ranks: str = doc("0", "Ranks to profile: 'all' or comma-separated rank numbers.")
    memory: bool = doc(
        False, "Also record memory; on CUDA write a snapshot for PyTorch's memory visualizer."
    )


@dataclass(kw_only=True, slots=True)
class WatchdogConfig:
    hang_timeout_s: float = doc(
        600.0,
        "Hang watchdog: when a rank's heartbeat (step, phase) has not moved for this long, every "
        "rank that still can dumps its Python stacks to logs/rank<N>.stacks and its flight "
        "record to flight/, one line names the stuck rank(s) and what the others wait in, and "
        "the job exits non-zero so --max-restarts can restart it (0 = off). Must exceed the "
        "longest step or evaluation; checkpoint reads and writes count as progress while bytes "
        "move, so it must exceed only the longest stall of the checkpoint storage.",
        AT_LEAST_0,
    )
    straggler_ratio: float = doc(
        1.5,
        "Warn when the slowest rank's compute time (data + forward, per logged step) exceeds "
        "this multiple of the median rank's (metrics: slowest_rank, straggler_ratio).",
        Range(low=1, low_open=True),
    )


@dataclass(kw_only=True, slots=True)
class FaultToleranceConfig:
    """Replica groups that survive each other (ft/replica_groups.py): each group is its own
    torchrun, shards the model with FSDP2 over its ranks, and averages gradients with the other
    groups through torchft's reconfigurable process group; a group that dies or hangs is left
    out, the survivors take its micro-batches, and a restarted group fetches the live state."""

    replica_groups: int = doc(
        0,
        "Replica groups in the run, each launched as its own torchrun (0 = off: every failure "
        "restarts the whole job). The global batch is the same whatever the number of groups "
        "alive: the survivors take a lost group's micro-batches.",
        Range(low=2, also=(0,), why="one group has no peer to survive it"),
    )
    group: int = doc(
        0, "This torchrun's replica group, 0 .. fault_tolerance.replica_groups - 1.", AT_LEAST_0
    )
    lighthouse: str = doc(
        "",
        "Address of the lighthouse (distrain lighthouse) that forms each step's quorum of groups "
        "(http://host:port; empty = the TORCHFT_LIGHTHOUSE environment variable).",
    )
    timeout_s: float = doc(
        30.0,
        "Seconds a collective between groups, or a group's vote to commit a step, may take "
        "before the groups that did not answer are taken for dead or hung and left out. It must "
        "exceed the time a rejoining group takes to load the live state: a shorter one makes "
        "every group redo that step once.",
        POSITIVE,
    )
    quorum_timeout_s: float = doc(
        120.0,
        "Seconds a group waits for the lighthouse to form a quorum (a group restarting after a "
        "failure waits here until the others reach a step boundary), asking again every quarter "
        "of it, so a lighthouse restarted within it costs no step; also how long the groups of "
        "a new run wait for each other before step 1, after which those present start.",
        POSITIVE,
    )
    secret_file: str = doc(
        "",
        "File holding the run secret (at least 16 bytes, readable by its owner only), the same "
        "on every host: every live-state transfer, every call to a group's manager server and "
        "every step's exchange between groups is authenticated with it (HMAC-SHA256), so a host "
        "that reaches the lighthouse or a group cannot join the groups, read their state, end "
        "them or steer their training. Required unless the lighthouse "
        "is on a loopback address (every group on one host). See docs/security.md.",
    )
    bind: str = doc(
        "",
        "Address this group's manager front and live-state server listen on (empty = the "
        "address of this host's interface toward the lighthouse, never every interface).",
    )
    peer_grad_norm_ratio: float = doc(
        10.0,
        "A step's exchange is refused (no group commits it) when one group's gradient norm is "
        "over this many times the median of the others' (0 = no such check); a non-finite "
        "gradient is always refused. Groups split one global batch alike, so their norms are "
        "close.",
        Range(low=1, low_open=True, also=(0,), why="a ratio of 1 or less refuses honest peers"),
    )


@dataclass(kw_only=True, slots=True)
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    diloco: DiLoCoConfig = field(default_factory=DiLoCoConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig)
    fault_tolerance: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)

    def validate(self) -> None:
        """Checks that need no knowledge of the world size or the model (layout/rules.py has
        those): every number within its field's range, then the relations between fields."""
        for name, value, f in numeric_fields(self):
            valid = f.metadata.get("range")
            # A word ("auto") is a choice of the field's type, not a number to range-check.
            if valid is not None and isinstance(value, int | float) and value not in valid:
                raise ConfigError(f"{name} = {value} is out of range: it must be {valid}")
        _validate_eval_sets(self.data.eval_sets)
        _validate_sources(self.data)
        t = self.training
        if t.micro_batch_size != "auto" and t.global_batch_size % t.micro_batch_size:
            raise ConfigError(
                f"training.global_batch_size ({t.global_batch_size}) must be a multiple of "
                f"training.micro_batch_size ({t.micro_batch_size})"
            )

    def sections(self) -> dict[str, Any]:
        """Each section by its name ("run", "model", ...), in the order they are declared."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Each section as a dict of its fields (nested sections as dicts, arrays of tables as
        lists), None values left out: TOML-ready (TOML has no null)."""
        return {
            name: _without_none(dataclasses.asdict(section))
            for name, section in self.sections().items()
        }


def _without_none(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, tuple):  # an array of tables
        return [_without_none(v) for v in value]
    return value


def numeric_fields(node: Any, path: str = "") -> list[tuple[str, Any, dataclasses.Field]]:
    """(dotted name, value, field) of every int/float field under `node`, nested sections too."""
    found = []
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        name = f"{path}.{f.name}" if path else f.name
        if dataclasses.is_dataclass(value):
            found += numeric_fields(value, name)
        elif "range" in f.metadata or (
            isinstance(value, int | float) and not isinstance(value, bool)
        ):
            found.append((name, value, f))
    return found


def source_names(data: DataConfig) -> list[str]:
    """Each mixture source's name: its own, else the last part of its path."""
    return [s.name or s.path.rstrip("/").rsplit("/", 1)[-1] for s in data.sources]


def _validate_sources(data: DataConfig) -> None:
    remote = [p for p in [data.path, *(s.path for s in data.sources)] if "://" in p]
    if remote and not data.cache_dir:
        raise ConfigError(
            f"data: {remote[0]!r} is remote: set data.cache_dir to a local folder for its shards"
        )
    if not data.sources:
        return
    if data.path:
        raise ConfigError(
            f"data.path ({data.path!r}) and data.sources are both set; use one (a mixture "
            "lists every source in [[data.sources]])"
        )
    for i, source in enumerate(data.sources):
        if not source.path:
            raise ConfigError(f"data.sources[{i}].path is empty; name a dataset")
        if not source.weight > 0:
            raise ConfigError(f"data.sources[{i}].weight = {source.weight} must be > 0")
    names = source_names(data)
    if len(set(names)) != len(names):
        raise ConfigError(
            f"data.sources have repeated names ({', '.join(names)}); give each a distinct name"
        )


def _validate_eval_sets(eval_sets: tuple[EvalSetConfig, ...]) -> None:
    seen: set[str] = set()
    for i, e in enumerate(eval_sets):
        where = f"data.eval_sets[{i}]"
        if not EVAL_SET_NAME.fullmatch(e.name):
            raise ConfigError(
                f"{where}.name = {e.name!r}: give each eval set a name of letters, digits, "
                "'_', '.' or '-' (it names the metrics val/NAME/loss)"
            )
        if e.name in seen:
            raise ConfigError(f"{where}.name = {e.name!r} is used twice; names must be unique")
        seen.add(e.name)
        if not e.path:
            raise ConfigError(f"{where} ({e.name}) has no path; set the file or folder to read")
        if e.max_bytes < 0:
            raise ConfigError(f"{where}.max_bytes = {e.max_bytes} is out of range: it must be >= 0")
