"""The run configuration's schema: typed dataclasses per component, a help text per field, and
the checks that need no knowledge of the world size (mesh.py has those that do).

A config is resolved in three layers (see config_io.py): the dataclass defaults, then a TOML file
(`--config`), then dotted command-line overrides (`--training.steps 200`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from distrain.errors import ConfigError


def doc(default: Any, help: str) -> Any:
    """A dataclass field with a default and a help text shown by `--help`."""
    return field(default=default, metadata={"help": help})


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
class ModelConfig:
    preset: str = doc("tiny", "Named model preset (see `distrain presets`).")
    vocab_size: int | None = doc(None, "Override the preset's vocabulary size.")
    dim: int | None = doc(None, "Override the preset's hidden size.")
    n_layers: int | None = doc(None, "Override the preset's number of transformer blocks.")
    n_heads: int | None = doc(None, "Override the preset's number of attention heads.")
    ffn_dim: int | None = doc(None, "Override the preset's MLP hidden size.")
    norm: Literal["rmsnorm", "layernorm"] | None = doc(None, "Override the preset's norm type.")
    pos_emb: Literal["rope", "learned"] | None = doc(None, "Override the position encoding.")
    tie_embeddings: bool | None = doc(
        None, "Override whether output and input embeddings share weights."
    )


@dataclass(kw_only=True, slots=True)
class DataConfig:
    path: str = doc(
        "",
        "Training data: a text file, a folder of text files, or a token file (.bin raw / .npy). "
        "Empty: the running Python's standard library source.",
    )
    format: Literal["auto", "text", "tokens"] = doc(
        "auto", "How to read data.path: auto decides by suffix (.bin/.npy = tokens)."
    )
    token_dtype: Literal["uint8", "uint16", "int32"] = doc(
        "uint16", "Element type of a raw .bin token file."
    )
    glob: str = doc("**/*", "Files to read when data.path is a folder (default corpus: **/*.py).")
    max_bytes: int = doc(0, "Read at most this many bytes of text (0 = all).")
    val_fraction: float = doc(0.05, "Fraction of the corpus held out for validation.")
    max_skew: float = doc(
        0.05, "Largest allowed relative difference between data-parallel ranks' sample counts."
    )
    skew_action: Literal["warn", "error"] = doc("warn", "What a data-skew above max_skew does.")


@dataclass(kw_only=True, slots=True)
class TrainingConfig:
    steps: int = doc(600, "Optimizer steps to train for.")
    global_batch_size: int = doc(
        32,
        "Sequences per optimizer step, summed over data-parallel ranks and accumulation steps.",
    )
    micro_batch_size: int = doc(8, "Sequences per forward/backward on one rank.")
    seq_len: int = doc(128, "Tokens per sequence.")
    precision: Literal["fp32", "bf16", "fp16"] = doc(
        "fp32", "Compute precision: bf16 by autocast; fp16 with loss scaling (CUDA only)."
    )
    seed: int = doc(1234, "Seed for model init, data order and all RNGs.")
    deterministic: bool = doc(False, "Use deterministic algorithms only (slower on GPU).")
    activation_checkpointing: Literal["none", "full", "selective"] = doc(
        "none",
        "Recompute activations in backward: full = whole blocks; selective = every "
        "training.ac_every_layers-th block.",
    )
    ac_every_layers: int = doc(
        2, "With selective activation checkpointing, checkpoint every k-th block."
    )
    compile: bool = doc(False, "torch.compile each transformer block.")
    oom_recovery: bool = doc(
        False,
        "Retry a step that runs out of memory with half the micro-batch and twice the "
        "accumulation (same global batch). Gradients are then all-reduced after the last "
        "backward instead of overlapping it; data-parallel layouts (no tp/pp/FSDP) only.",
    )
    log_interval_steps: int = doc(10, "Steps between metric rows and progress updates.")
    eval_interval_steps: int = doc(100, "Steps between validation passes (0 = only at the end).")
    eval_batches: int = doc(4, "Micro-batches per rank in a validation pass.")


@dataclass(kw_only=True, slots=True)
class OneBitConfig:
    freeze_step: int = doc(
        100,
        "1-bit Adam: steps of ordinary Adam (fp32 gradient all-reduce) before the variance is "
        "frozen and the momentum is communicated 1-bit compressed.",
    )


@dataclass(kw_only=True, slots=True)
class OptimConfig:
    name: Literal["adamw", "onebit_adam"] = doc(
        "adamw", "Optimizer: adamw, or onebit_adam (Tang et al. 2021; DDP layouts only)."
    )
    lr: float = doc(2e-3, "Peak learning rate.")
    min_lr_ratio: float = doc(0.1, "Final learning rate of the cosine decay, as a fraction of lr.")
    warmup_steps: int = doc(20, "Linear warmup steps.")
    weight_decay: float = doc(0.1, "AdamW weight decay (not applied to norms, biases, embeddings).")
    beta1: float = doc(0.9, "AdamW beta1.")
    beta2: float = doc(0.95, "AdamW beta2.")
    eps: float = doc(1e-8, "AdamW epsilon.")
    max_grad_norm: float = doc(1.0, "Clip gradients to this global norm (0 = no clipping).")
    onebit: OneBitConfig = field(default_factory=OneBitConfig)


@dataclass(kw_only=True, slots=True)
class ParallelConfig:
    dp_replicate: int = doc(
        -1,
        "Data-parallel replicas (DDP, or HSDP's replicate axis); -1 = what is left over "
        "(when zero_stage <= 1).",
    )
    dp_shard: int = doc(
        -1,
        "Data-parallel shards (FSDP2, zero_stage 2/3); -1 = what is left over (1 when zero_stage "
        "<= 1).",
    )
    tp: int = doc(1, "Tensor-parallel degree (Megatron column/row split, heads across ranks).")
    pp: int = doc(1, "Pipeline-parallel degree (stages across ranks).")
    pp_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"] = doc(
        "1f1b", "Pipeline schedule (torch.distributed.pipelining)."
    )
    pp_microbatches: int = doc(
        -1,
        "Pipeline micro-batches per step per data-parallel rank; -1 = global batch / "
        "(micro_batch_size x data-parallel size).",
    )
    pp_stages_per_rank: int = doc(
        1, "Pipeline stages per rank (>= 2 for the interleaved and zero-bubble schedules)."
    )
    zero_stage: int = doc(
        0,
        "ZeRO stage: 0 DDP; 1 + optimizer state sharded; 2 + gradients sharded (FSDP2, no "
        "reshard after forward); 3 + parameters sharded (FSDP2).",
    )
    sequence_parallel: bool = doc(
        True, "With tp > 1, shard norms and the residual stream along the sequence."
    )


@dataclass(kw_only=True, slots=True)
class CommConfig:
    bucket_cap_mb: float = doc(25.0, "DDP gradient bucket size in MiB.")
    gradient_compression: Literal["none", "fp16", "bf16", "powersgd", "onebit"] = doc(
        "none",
        "DDP gradient compression hook: fp16/bf16 casts; powersgd low-rank (with error "
        "feedback); onebit = signs + one scale per bucket, with error feedback.",
    )
    powersgd_rank: int = doc(2, "PowerSGD approximation rank.")
    powersgd_start_step: int = doc(
        10, "PowerSGD: steps of uncompressed all-reduce before compression starts."
    )
    hierarchical: bool = doc(
        False,
        "Topology-aware all-reduce: reduce inside each node, all-reduce across one rank per "
        "node, broadcast inside the node (node size from torchrun's LOCAL_WORLD_SIZE).",
    )


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    dir: str = doc(
        "",
        "Where checkpoints go: a folder or an fsspec URL (s3://bucket/run); empty = "
        "<run_dir>/checkpoints.",
    )
    interval_steps: int = doc(200, "Steps between temporary checkpoints (0 = off).")
    interval_minutes: float = doc(60.0, "Minutes between temporary checkpoints (0 = off).")
    keep_temporary: int = doc(2, "Newest temporary checkpoints kept; older ones are deleted.")
    permanent_every_steps: int = doc(0, "Steps between permanent checkpoints (0 = off).")
    permanent_every_minutes: float = doc(
        360.0, "Minutes between permanent checkpoints, never deleted by retention (0 = off)."
    )
    at_end: bool = doc(True, "Save a (permanent) checkpoint after the last step.")
    async_mode: Literal["none", "async"] = doc(
        "none",
        "async: write checkpoints in the background while training goes on (at most one in "
        "flight; the next save and the end of training wait for it).",
    )
    preempt_grace_s: int = doc(
        120,
        "Seconds a stop signal (SIGTERM, SIGUSR1, SIGINT) leaves the run to finish its step and "
        "commit a `preempt` checkpoint before it exits (rc 75); the launcher kills workers that "
        "take longer, and `distrain slurm` asks Slurm for the signal this long before the time "
        "limit.",
    )


@dataclass(kw_only=True, slots=True)
class MetricsConfig:
    tensorboard: bool = doc(True, "Write TensorBoard event files under <run_dir>/tb/.")
    progress_bar: bool = doc(True, "Show a progress bar on rank 0.")


@dataclass(kw_only=True, slots=True)
class DebugConfig:
    fail_at_step: int = doc(
        0, "Fault injection: crash when this step begins (0 = never); for tests and chaos runs."
    )
    fail_rank: int = doc(-1, "Rank that crashes at debug.fail_at_step (-1 = every rank).")
    fail_mode: Literal["exception", "kill"] = doc(
        "exception", "How the injected crash happens: raise an exception, or SIGKILL the process."
    )
    fail_attempt: int = doc(
        0,
        "Crash only in this attempt of an elastic run (torchrun's restart count), so the "
        "restarted workers run on.",
    )
    corrupt_checkpoint_step: int = doc(
        0,
        "Fault injection: after the checkpoint of this step is committed, flip one byte of one "
        "of its shard files, so the next resume must detect it and fall back (0 = never).",
    )
    oom_at_step: int = doc(
        0, "Fault injection: raise an out-of-memory error inside this step (0 = never)."
    )
    oom_rank: int = doc(-1, "Rank that runs out of memory at debug.oom_at_step (-1 = every rank).")
    preempt_delay_s: float = doc(
        0.0,
        "Fault injection: after a stop signal, wait this long between writing the preempt "
        "checkpoint (with checkpoint.async_mode = 'async') and committing it, so a test can "
        "send a second signal during the save.",
    )
    check_replicas: bool = doc(
        False,
        "After every logged step, check that parameters agree across data-parallel replicas; a "
        "mismatch names the tensor and the ranks.",
    )


@dataclass(kw_only=True, slots=True)
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)


def sections(cfg: Config) -> dict[str, Any]:
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}


def validate(cfg: Config) -> None:
    """Checks that need no knowledge of the world size (see mesh.py for those that do)."""
    t = cfg.training
    positive = {
        "training.steps": t.steps,
        "training.global_batch_size": t.global_batch_size,
        "training.micro_batch_size": t.micro_batch_size,
        "training.seq_len": t.seq_len,
        "training.log_interval_steps": t.log_interval_steps,
        "training.eval_batches": t.eval_batches,
        "training.ac_every_layers": t.ac_every_layers,
    }
    for name, value in positive.items():
        if value <= 0:
            raise ConfigError(f"{name} must be > 0, got {value}")
    if t.global_batch_size % t.micro_batch_size:
        raise ConfigError(
            f"training.global_batch_size ({t.global_batch_size}) must be a multiple of "
            f"training.micro_batch_size ({t.micro_batch_size})"
        )
    if not 0.0 < cfg.data.val_fraction < 1.0:
        raise ConfigError(f"data.val_fraction must be in (0, 1), got {cfg.data.val_fraction}")
    if cfg.optim.lr <= 0:
        raise ConfigError(f"optim.lr must be > 0, got {cfg.optim.lr}")
    if cfg.parallel.zero_stage not in (0, 1, 2, 3):
        raise ConfigError(
            f"parallel.zero_stage must be 0, 1, 2 or 3, got {cfg.parallel.zero_stage}"
        )
    if cfg.comm.powersgd_start_step < 2:
        raise ConfigError(
            "comm.powersgd_start_step must be >= 2 (DDP rebuilds its buckets after step 1)"
        )
    if cfg.comm.bucket_cap_mb <= 0:
        raise ConfigError(f"comm.bucket_cap_mb must be > 0, got {cfg.comm.bucket_cap_mb}")
    for name in (
        "checkpoint.interval_steps",
        "checkpoint.interval_minutes",
        "checkpoint.permanent_every_steps",
        "checkpoint.permanent_every_minutes",
        "checkpoint.keep_temporary",
        "training.eval_interval_steps",
    ):
        section, key = name.split(".")
        if getattr(getattr(cfg, section), key) < 0:
            raise ConfigError(f"{name} must be >= 0")
    grace_s = cfg.checkpoint.preempt_grace_s
    if grace_s < 1:
        raise ConfigError(f"checkpoint.preempt_grace_s must be >= 1 (seconds), got {grace_s}")
