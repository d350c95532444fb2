"""Bad input is refused in one line, before any worker starts: the layout rule table
(distrain/layout/rules.py), the numeric ranges of the schema, the launcher's preflight of paths,
and the command line's own arguments."""

from __future__ import annotations

import ast
import dataclasses
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from distrain_residual_mlp.spec import SPEC as RESIDUAL_MLP
from helpers import FAST, overrides, run_cli, train_in_process

import distrain.launch.torchrun
from distrain import cli
from distrain.config.io import help_text, load_config, parse_overrides
from distrain.config.schema import Config, ConfigError, numeric_fields
from distrain.layout.rules import RULES, LayoutError, validate
from distrain.models.registry import register_family

# In the compat suite (.ci/run: also on the oldest and newest torch): the CLI's refusals.
pytestmark = pytest.mark.compat

# A 300-token BPE (tokenizers' trainer on json/decoder.py of the stdlib), for the tokenizer rules.
BPE_300 = Path(__file__).parent / "data" / "bpe-300.json"

# Replica groups: 2 groups of ZeRO-3 over 2 ranks, a global batch of 8 in micro-batches of 2.
FT = {
    "fault_tolerance.replica_groups": "2",
    "fault_tolerance.lighthouse": "http://localhost:1",
    "parallel.zero_stage": "3",
    "training.global_batch_size": "8",
    "training.micro_batch_size": "2",
}

# (rule, overrides, world size, texts the one-line message must hold). Every rule of the table
# appears at least once (test_every_rule_is_tested); "cuda" makes torch report CUDA present;
# "env.NAME" sets the environment variable NAME.
# The residual MLP plugin family (tests/plugins) and a copy of it without a tensor-parallel
# plan: what a family lacks is refused before launch.
register_family(RESIDUAL_MLP)
register_family(dataclasses.replace(RESIDUAL_MLP, name="residual_mlp_no_tp", tensor_plan=None))
RMLP = {"model.family": "residual_mlp", "model.preset": "rmlp-tiny"}

CASES = [
    ("tp_needs_plan", {**RMLP, "model.family": "residual_mlp_no_tp", "parallel.tp": "2"}, 2,
     ["parallel.tp (2): the 'residual_mlp_no_tp' model family has no tensor-parallel plan",
      "set parallel.tp = 1"]),
    ("sequence_parallel_needs_plan", {**RMLP, "parallel.tp": "2"}, 2,
     ["the 'residual_mlp' model family's tensor-parallel plan has no sequence-parallel variant",
      "set parallel.sequence_parallel = false"]),
    ("lora_layouts_proven", {"lora.rank": "4", "parallel.cp": "2"}, 2,
     ["lora.rank (4) trains under DDP, FSDP2", "not yet with parallel.cp = 2 (context "
      "parallelism): no test proves it; set parallel.cp = 1, or set lora.rank = 0"]),
    ("lora_layouts_proven",
     {"lora.rank": "4", "diloco.inner_steps": "4", "parallel.zero_stage": "2",
      "parallel.dp_replicate": "2"}, 2,
     ["not yet with diloco.inner_steps = 4 (DiLoCo): no test proves it; set "
      "diloco.inner_steps = 0, or set lora.rank = 0"]),
    ("lora_layouts_proven", {"lora.rank": "4", "optim.name": "onebit_adam"}, 2,
     ["not yet with optim.name = 'onebit_adam' (1-bit Adam): no test proves it; set "
      "optim.name = 'adamw', or set lora.rank = 0"]),
    ("cp_needs_attention", {**RMLP, "parallel.cp": "2"}, 2,
     ["parallel.cp (2): the 'residual_mlp' model family has no attention for context "
      "parallelism to split; set parallel.cp = 1"]),
    ("seq_len_within_model", {"training.seq_len": "2048"}, 1,
     ["training.seq_len (2048) exceeds the model's max_seq_len (1024, preset 'tiny')",
      "at most 1024", "model.max_seq_len = 2048"]),
    ("tokenizer_needs_token_file", {"data.tokenizer": f"hf:{BPE_300}"}, 1,
     [f"data.tokenizer = 'hf:{BPE_300}' trains on token files", "set data.path = DATA.bin"]),
    ("vocab_holds_tokenizer",
     {"data.tokenizer": f"hf:{BPE_300}", "data.path": "prepared.bin"}, 1,
     ["model.vocab_size (256, preset 'tiny') is smaller than the vocabulary of data.tokenizer",
      "(300); set model.vocab_size to at least 300 (e.g. 320)"]),
    ("cuda_available", {"run.device": "cuda"}, 1,
     ["run.device = 'cuda' but CUDA is not available", "use auto or cpu"]),
    ("oom_recovery_without_comm_hooks",
     {"training.oom_recovery": "true", "comm.gradient_compression": "powersgd"}, 2,
     ["comm.gradient_compression ('powersgd')", "turn training.oom_recovery off"]),
    ("oom_recovery_without_comm_hooks",
     {"training.oom_recovery": "true", "comm.hierarchical": "true"}, 2,
     ["comm.hierarchical (True) would be skipped"]),
    ("comm_hooks_need_ddp", {"comm.gradient_compression": "fp16", "parallel.zero_stage": "2"}, 2,
     ["DDP communication hooks", "zero_stage 2, tp 1, pp 1 here"]),
    ("one_comm_hook", {"comm.gradient_compression": "bf16", "comm.hierarchical": "true"}, 2,
     ["DDP takes one communication hook"]),
    ("onebit_adam_plain_data_parallel", {"optim.name": "onebit_adam", "parallel.zero_stage": "3"},
     2, ["does not compose with parallel.zero_stage = 3 (FSDP2 reduce-scatters fp32 gradients "
         "itself inside backward)", "or zero_stage 0 with tp/pp"]),
    ("onebit_adam_plain_data_parallel",
     {"optim.name": "onebit_adam", "parallel.zero_stage": "1", "parallel.tp": "2"}, 4,
     ["parallel.zero_stage = 1 under tp 2 / pp 1 (its owner chunks would mix tp-replicated and "
      "sharded values; not supported yet)"]),
    ("onebit_adam_plain_data_parallel",
     {"optim.name": "onebit_adam", "parallel.zero_stage": "2", "parallel.pp": "2"}, 4,
     ["parallel.zero_stage = 2 under tp 1 / pp 2"]),
    ("onebit_adam_plain_data_parallel",
     {"optim.name": "onebit_adam", "training.oom_recovery": "true"}, 2,
     ["does not compose with training.oom_recovery (its retry all-reduces the gradients"]),
    ("onebit_adam_plain_data_parallel",
     {"optim.name": "onebit_adam", "comm.gradient_compression": "fp16"}, 2,
     ["comm.gradient_compression = 'fp16' (a DDP hook"]),
    ("tp_splits_model", {"parallel.tp": "2", "model.vocab_size": "255"}, 2,
     ["model.vocab_size (255) must be divisible by parallel.tp (2); choose parallel.tp in {1}"]),
    ("tp_splits_model",
     {"parallel.tp": "4", "model.n_heads": "6", "model.dim": "48", "model.ffn_dim": "96",
      "model.vocab_size": "96"}, 4,
     ["model.n_heads (6) must be divisible by parallel.tp (4)", "in {1, 2, 3, 6}"]),
    ("tp_splits_model",
     {"parallel.tp": "4", "model.family": "llama", "model.preset": "llama-tiny"}, 4,
     ["model.n_kv_heads (2) must be divisible by parallel.tp (4)", "in {1, 2}"]),
    ("sequence_parallel_splits_seq_len", {"parallel.tp": "2", "training.seq_len": "127"}, 2,
     ["splits the 127 positions", "multiple of 2", "parallel.sequence_parallel = false"]),
    ("cp_composes_with_dp_tp", {"parallel.cp": "2", "model.moe.num_experts": "4"}, 2,
     ["not compose with an MoE model (model.moe.num_experts = 4; its balancing losses"]),
    ("cp_splits_seq_len", {"parallel.cp": "4", "training.seq_len": "100"}, 4,
     ["2 x parallel.cp = 8 equal chunks", "a multiple of 8", "a smaller parallel.cp"]),
    ("cp_with_sequence_parallel",
     {"parallel.cp": "2", "parallel.tp": "4", "training.seq_len": "12"}, 8,
     ["context-parallel rank's 6 positions", "parallel.tp (4)", "a multiple of 8",
      "parallel.sequence_parallel = false"]),
    ("cp_composes_with_dp_tp",
     {"parallel.cp": "2", "parallel.zero_stage": "1", "parallel.tp": "2"}, 4,
     ["parallel.cp = 2 does not compose with parallel.zero_stage = 1 with parallel.tp = 2 "
      "(FSDP2 shards over cp", "set parallel.cp = 1 or drop that setting"]),
    ("single_stage_schedule",
     {"parallel.pp": "2", "parallel.pp_schedule": "gpipe", "parallel.pp_stages_per_rank": "2"}, 2,
     ["'gpipe' runs one stage per rank", "use interleaved_1f1b or zero_bubble"]),
    ("multi_stage_schedule", {"parallel.pp": "2", "parallel.pp_schedule": "zero_bubble"}, 2,
     ["'zero_bubble' interleaves several stages", "parallel.pp_stages_per_rank = 1"]),
    ("a_layer_per_stage",
     {"parallel.pp": "2", "parallel.pp_schedule": "interleaved_1f1b",
      "parallel.pp_stages_per_rank": "4"}, 2,
     ["model.n_layers (4) must be at least the number of pipeline stages (8"]),
    ("ep_needs_experts", {"parallel.ep": "2"}, 2,
     ["parallel.ep (2) splits the experts of MoE layers",
      "model.moe.num_experts = 0, preset 'tiny'"]),
    ("ep_splits_experts", {"parallel.ep": "3", "model.moe.num_experts": "4"}, 3,
     ["model.moe.num_experts (4) must be divisible by parallel.ep (3)",
      "choose parallel.ep in {1, 2, 4}"]),
    ("ep_runs_on_fsdp",
     {"parallel.ep": "2", "model.moe.num_experts": "4", "comm.gradient_compression": "bf16"}, 2,
     ["comm.gradient_compression = 'bf16' replaces DDP's gradient all-reduce through a DDP "
      "communication hook, but parallel.ep = 2 runs on FSDP2", "or set parallel.ep = 1"]),
    ("ep_runs_on_fsdp",
     {"parallel.ep": "2", "model.moe.num_experts": "4", "optim.name": "onebit_adam"}, 2,
     ["optim.name = 'onebit_adam' replaces DDP's gradient all-reduce"]),
    ("cp_divides_world", {"parallel.cp": "2", "parallel.tp": "2"}, 6,
     ["parallel.tp (2) x parallel.pp (1) x parallel.cp (2) = 4 does not divide the world size 6",
      "a multiple of 4 processes"]),
    ("tp_pp_divide_world", {"parallel.tp": "2"}, 3,
     ["parallel.tp (2) x parallel.pp (1) = 2 does not divide the world size 3",
      "a multiple of 2 processes"]),
    ("dp_shard_needs_fsdp", {"parallel.dp_shard": "2"}, 2,
     ["parallel.dp_shard = 2 needs parallel.zero_stage 2 or 3"]),
    ("dp_replicate_is_dp", {"parallel.dp_replicate": "4"}, 2,
     ["parallel.dp_replicate (4) must equal the data-parallel size 2 "
      "(world 2 / (cp 1 x tp 1 x pp 1))",
      "set it to -1 (what is left over) or run 4 processes"]),
    # With cp the arithmetic names cp too: dp = world // (cp x tp x pp), 8 // 4 = 2.
    ("dp_replicate_is_dp", {"parallel.dp_replicate": "4", "parallel.cp": "2", "parallel.tp": "2"},
     8,
     ["parallel.dp_replicate (4) must equal the data-parallel size 2 "
      "(world 8 / (cp 2 x tp 2 x pp 1))", "or run 16 processes"]),
    ("dp_replicate_divides_dp", {"parallel.zero_stage": "3", "parallel.dp_replicate": "3"}, 4,
     ["parallel.dp_replicate (3) must divide the data-parallel size 4", "one of 1, 2, 4"]),
    ("dp_shard_divides_dp", {"parallel.zero_stage": "2", "parallel.dp_shard": "3"}, 4,
     ["parallel.dp_shard (3) must divide the data-parallel size 4", "one of 1, 2, 4"]),
    ("dp_degrees_fill_dp",
     {"parallel.zero_stage": "3", "parallel.dp_replicate": "2", "parallel.dp_shard": "4"}, 4,
     ["parallel.dp_replicate (2) x parallel.dp_shard (4) must equal the data-parallel size 4"]),
    ("ep_divides_dp", {"parallel.ep": "4", "model.moe.num_experts": "4"}, 2,
     ["parallel.ep (4) must divide the data-parallel size 2 (world 2 / (cp 1 x tp 1 x pp 1))",
      "choose one of 1, 2"]),
    ("batch_splits_over_dp", {}, 3,
     ["training.global_batch_size (32) must be a multiple of training.micro_batch_size (8) x "
      "data-parallel size (3, from world size 3)"]),
    ("ddp_detail_debug_on_gloo", {"env.TORCH_DISTRIBUTED_DEBUG": "DETAIL"}, 2,
     ["TORCH_DISTRIBUTED_DEBUG=DETAIL makes torch 2.13's DDP crash on gloo",
      "set TORCH_DISTRIBUTED_DEBUG=INFO", "parallel.zero_stage 2 or 3"]),
    ("ddp_detail_debug_on_gloo",
     {"env.TORCH_DISTRIBUTED_DEBUG": "detail", "parallel.zero_stage": "1"}, 2,
     ["TORCH_DISTRIBUTED_DEBUG=DETAIL"]),
    ("pp_microbatches_split_batch", {"parallel.pp": "2", "parallel.pp_microbatches": "3"}, 2,
     ["a local batch of 32 sequences", "parallel.pp_microbatches = 3", "a divisor of 32"]),
    ("sgd_without_zero1", {"optim.name": "sgd", "parallel.zero_stage": "1"}, 2,
     ["optim.name = 'sgd' has no ZeRO-1", "set parallel.zero_stage to 0, 2 or 3"]),
    ("diloco_needs_fsdp", {"diloco.inner_steps": "4"}, 2,
     ["diloco.inner_steps = 4 needs parallel.zero_stage 2 or 3",
      "DDP (zero_stage 0) would average them over every site", "set parallel.zero_stage = 2"]),
    ("diloco_composes",
     {"diloco.inner_steps": "4", "parallel.zero_stage": "2", "optim.name": "onebit_adam"}, 2,
     ["does not compose with optim.name = 'onebit_adam'", "or set diloco.inner_steps = 0"]),
    ("diloco_composes",
     {"diloco.inner_steps": "4", "parallel.zero_stage": "2", "debug.check_replicas": "true"}, 2,
     ["debug.check_replicas (the sites' weights differ between outer steps)"]),
    ("diloco_fragments_fit",
     {"diloco.inner_steps": "2", "parallel.zero_stage": "2", "diloco.fragments": "3"}, 2,
     ["diloco.fragments = 3 exceeds diloco.inner_steps = 2", "set diloco.fragments to 2 or less"]),
    ("diloco_overlap_fits",
     {"diloco.inner_steps": "4", "parallel.zero_stage": "2", "diloco.fragments": "2",
      "diloco.overlap_steps": "2"}, 2,
     ["diloco.overlap_steps = 2 must be below diloco.inner_steps // diloco.fragments = 4 // 2",
      "lower it or raise diloco.inner_steps"]),
    ("diloco_needs_sites", {"diloco.inner_steps": "4", "parallel.zero_stage": "2"}, 2,
     ["averages over sites, the parallel.dp_replicate groups, but this layout has 1",
      "set parallel.dp_replicate to 2 or more"]),
    ("auto_micro_batch_needs_budget", {"training.micro_batch_size": "auto"}, 1,
     ["training.micro_batch_size = 'auto' on CPU needs training.memory_budget_gb",
      "set it, or set training.micro_batch_size to a number"]),
    ("auto_micro_batch_without_pp",
     {"training.micro_batch_size": "auto", "training.memory_budget_gb": "2", "parallel.pp": "2"},
     2, ["does not apply with parallel.pp = 2", "or parallel.pp = 1"]),
    ("auto_batch_splits_over_dp",
     {"training.micro_batch_size": "auto", "training.memory_budget_gb": "2",
      "training.global_batch_size": "9"}, 2,
     ["training.global_batch_size (9) must be a multiple of the data-parallel size (2, from "
      "world size 2) for training.micro_batch_size = 'auto'"]),
    ("replica_group_in_range",
     {**FT, "fault_tolerance.group": "2"}, 2,
     ["fault_tolerance.group = 2 is not one of the 2 replica groups", "set it to 0 .. 2 - 1"]),
    ("fault_tolerance_needs_fsdp", {**FT, "parallel.zero_stage": "0"}, 2,
     ["fault_tolerance.replica_groups = 2 needs parallel.zero_stage 2 or 3",
      "set parallel.zero_stage = 3"]),
    ("fault_tolerance_composes", {**FT, "parallel.cp": "2"}, 2,
     ["does not compose with parallel.cp = 2 (not supported yet: no test runs context "
      "parallelism inside a replica group)", "set fault_tolerance.replica_groups = 0"]),
    ("fault_tolerance_needs_lighthouse", {**FT, "fault_tolerance.lighthouse": ""}, 2,
     ["needs a lighthouse (distrain lighthouse)", "or TORCHFT_LIGHTHOUSE"]),
    ("fault_tolerance_needs_secret",
     {**FT, "fault_tolerance.lighthouse": "http://lh.example:29510"}, 2,
     ["fault_tolerance.lighthouse = 'http://lh.example:29510' is not on a loopback address",
      "set fault_tolerance.secret_file"]),
    # A loopback lighthouse with servers bound to every interface: they answer the network.
    ("fault_tolerance_needs_secret", {**FT, "fault_tolerance.bind": "0.0.0.0"}, 2,
     ["fault_tolerance.bind = '0.0.0.0' is not a loopback address",
      "set fault_tolerance.secret_file", "or bind = '127.0.0.1'"]),
    ("batch_splits_over_survivors", {**FT, "training.global_batch_size": "4"}, 2,
     ["training.global_batch_size (4) cannot be split by 2 live replica group(s) of 2 "
      "data-parallel rank(s) in micro-batches of 2",
      "make it a multiple of 8"]),
    # Under pp the pipeline microbatch (8 sequences alone here) keeps its size for survivors.
    ("batch_splits_over_survivors", {**FT, "parallel.pp": "2", "parallel.pp_microbatches": "1"}, 2,
     ["cannot be split by 2 live replica group(s) of 1 data-parallel rank(s) in micro-batches "
      "of 8", "make it a multiple of 16"]),
    ("pipeline_suits_survivors",
     {**FT, "parallel.pp": "2", "training.micro_batch_size": "4"}, 2,
     ["parallel.pp_schedule = '1f1b' cannot run the pipeline of 2 live group(s): 1 "
      "microbatch(es) of 4 per data-parallel rank (2 stages)"]),
]  # fmt: skip


def _config(fields: dict[str, str]) -> Config:
    return load_config(
        None, [(k, v) for k, v in fields.items() if k != "cuda" and not k.startswith("env.")]
    )


@pytest.fixture
def cuda_present(monkeypatch: pytest.MonkeyPatch):
    """Make torch report CUDA (present or not) as a case needs, whatever this machine has."""

    def set_present(present: bool) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: present)

    return set_present


@pytest.mark.parametrize(("rule", "fields", "world_size", "texts"), CASES)
def test_layout_rule_refuses_in_one_line(
    rule, fields, world_size, texts, cuda_present, monkeypatch
):
    cuda_present("cuda" in fields)
    for key, value in fields.items():
        if key.startswith("env."):
            monkeypatch.setenv(key.removeprefix("env."), value)
    cfg = _config(fields)
    with pytest.raises(LayoutError) as info:
        validate(cfg, world_size)
    message = str(info.value)
    assert info.value.rule == rule, message
    assert "\n" not in message
    for text in texts:
        assert text in message


def test_every_rule_is_tested():
    assert {case[0] for case in CASES} == {rule.name for rule in RULES}
    assert len({rule.name for rule in RULES}) == len(RULES)


def test_fixes_named_by_messages_are_accepted(cuda_present):
    """The alternatives the messages offer pass the same table."""
    cuda_present(False)
    fixed = [
        ({"training.seq_len": "2048", "model.max_seq_len": "2048"}, 1),
        ({"data.tokenizer": f"hf:{BPE_300}", "data.path": "a.bin", "model.vocab_size": "320"}, 1),
        ({"parallel.dp_replicate": "-1"}, 2),
        ({"parallel.dp_replicate": "2"}, 2),
        ({"parallel.dp_replicate": "4"}, 4),
        ({"parallel.zero_stage": "3", "parallel.dp_replicate": "2"}, 4),
        ({"parallel.pp": "2", "parallel.pp_microbatches": "4"}, 2),
        ({"training.oom_recovery": "true"}, 2),
        ({"comm.gradient_compression": "powersgd"}, 2),
        ({"parallel.tp": "2", "parallel.pp": "2", "parallel.sequence_parallel": "false"}, 4),
        ({"parallel.tp": "2", "model.family": "llama", "model.preset": "llama-tiny"}, 2),
        ({"parallel.cp": "4", "training.seq_len": "104"}, 4),
        ({"parallel.cp": "2", "parallel.tp": "4", "training.seq_len": "16"}, 8),
        (
            {
                "parallel.cp": "2",
                "parallel.tp": "4",
                "training.seq_len": "12",
                "parallel.sequence_parallel": "false",
            },
            8,
        ),
        ({"parallel.cp": "2", "parallel.zero_stage": "3"}, 4),
        ({"parallel.cp": "2", "parallel.zero_stage": "1"}, 4),
        ({"parallel.cp": "2", "parallel.pp": "2"}, 4),
        ({"parallel.cp": "2", "parallel.pp": "2", "parallel.zero_stage": "1"}, 8),
        ({"parallel.cp": "2", "training.precision": "fp16"}, 2),
        ({"parallel.cp": "2", "training.oom_recovery": "true"}, 2),
        ({"parallel.cp": "2", "comm.gradient_compression": "fp16"}, 2),
        ({"parallel.cp": "2", "comm.hierarchical": "true"}, 2),
        ({"parallel.cp": "2", "optim.name": "onebit_adam", "parallel.zero_stage": "1"}, 2),
        ({"training.micro_batch_size": "auto", "training.memory_budget_gb": "2"}, 2),
        (
            {
                "training.micro_batch_size": "auto",
                "training.memory_budget_gb": "2",
                "parallel.zero_stage": "3",
                "training.global_batch_size": "10",
            },
            2,
        ),
        ({"optim.name": "onebit_adam", "parallel.zero_stage": "1"}, 2),
        ({"optim.name": "onebit_adam", "parallel.zero_stage": "2"}, 2),
        ({"parallel.ep": "2", "model.moe.num_experts": "4", "training.precision": "fp16"}, 2),
        ({"model.moe.num_experts": "4", "parallel.tp": "2"}, 2),
        ({"model.moe.num_experts": "4", "parallel.tp": "2"}, 4),
        ({"parallel.ep": "2", "model.moe.num_experts": "4", "parallel.zero_stage": "1"}, 2),
        (
            {
                "model.preset": "moe-tiny",
                "parallel.pp": "2",
                "parallel.pp_schedule": "zero_bubble",
                "parallel.pp_stages_per_rank": "2",
            },
            2,
        ),
        (
            {
                "model.preset": "moe-tiny",
                "parallel.pp": "2",
                "parallel.tp": "2",
                "parallel.ep": "2",
                "parallel.pp_schedule": "interleaved_1f1b",
                "parallel.pp_stages_per_rank": "2",
            },
            8,
        ),
        ({"model.moe.num_experts": "4", "parallel.tp": "2", "parallel.ep": "2"}, 8),
        ({"parallel.ep": "2", "model.moe.num_experts": "4", "training.oom_recovery": "true"}, 2),
        ({"optim.name": "onebit_adam", "parallel.tp": "2"}, 4),
        ({"optim.name": "sgd", "parallel.zero_stage": "2"}, 2),
        ({"diloco.inner_steps": "4", "parallel.zero_stage": "2", "parallel.dp_replicate": "2"}, 2),
        (
            {
                "diloco.inner_steps": "4",
                "parallel.zero_stage": "2",
                "parallel.dp_replicate": "2",
                "diloco.fragments": "2",
                "diloco.overlap_steps": "1",
            },
            2,
        ),
        (
            {
                "diloco.inner_steps": "4",
                "parallel.zero_stage": "3",
                "parallel.dp_replicate": "2",
                "parallel.tp": "2",
            },
            8,
        ),
        ({"optim.name": "onebit_adam", "parallel.pp": "2"}, 4),
        ({"optim.name": "onebit_adam", "parallel.tp": "2", "parallel.pp": "2"}, 8),
        # The layouts test_lora.py proves LoRA under (replica groups included).
        ({"lora.rank": "4", "parallel.zero_stage": "3"}, 2),
        ({"lora.rank": "4", "parallel.tp": "2", "parallel.sequence_parallel": "true"}, 2),
        ({"lora.rank": "4", "parallel.pp": "2"}, 2),
        ({"lora.rank": "4", "parallel.tp": "2", "parallel.pp": "2"}, 4),
        ({"lora.rank": "4", **FT}, 2),
        # The fixes lora_layouts_proven names for 1-bit Adam and DiLoCo.
        ({"lora.rank": "4", "optim.name": "adamw"}, 2),
        ({"lora.rank": "0", "optim.name": "onebit_adam"}, 2),
        (
            {
                "lora.rank": "0",
                "diloco.inner_steps": "4",
                "parallel.zero_stage": "2",
                "parallel.dp_replicate": "2",
            },
            2,
        ),
    ]
    for fields, world_size in fixed:
        layout = validate(_config(fields), world_size)
        assert layout.dims is not None and layout.dims.world_size == world_size


def test_detail_debug_refuses_ddp_on_gloo_only(monkeypatch):
    """Under DETAIL the layouts without DDP (FSDP2, tp, one process) and INFO still pass."""
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "DETAIL")
    for fields, world_size in [
        ({"parallel.zero_stage": "2"}, 2),
        ({"parallel.tp": "2"}, 2),
        ({"parallel.pp": "2", "parallel.pp_microbatches": "4"}, 2),
        ({}, 1),
    ]:
        assert validate(_config(fields), world_size).dims.world_size == world_size
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "INFO")
    assert validate(_config({}), 2).dims.dp_wrapper == "ddp"


def test_onebit_adam_under_zero2_runs_unwrapped():
    """1-bit Adam under ZeRO-2 averages the gradients itself: neither DDP nor FSDP2 wraps the
    model; AdamW's ZeRO-2 stays FSDP2."""
    onebit = validate(_config({"optim.name": "onebit_adam", "parallel.zero_stage": "2"}), 2)
    assert onebit.dims.dp_wrapper == "optimizer"
    # The parameters are whole on every dp rank: debug.check_replicas compares them all.
    assert (onebit.dims.dp_replicate, onebit.dims.dp_shard) == (2, 1)
    assert validate(_config({"parallel.zero_stage": "2"}), 2).dims.dp_wrapper == "fsdp"


@pytest.mark.parametrize(
    ("name", "zero_stage", "tp", "declared"),
    [
        ("adamw", 0, 1, set()),
        ("adamw", 2, 2, set()),
        ("onebit_adam", 0, 1, {"exchanges_momentum"}),
        ("onebit_adam", 0, 2, {"exchanges_momentum", "averages_gradients"}),
        ("onebit_adam", 1, 1, {"exchanges_momentum", "shards_state"}),
        ("onebit_adam", 2, 1, {"exchanges_momentum", "shards_state", "shards_gradients"}),
    ],
)
def test_the_optimizer_declares_what_it_takes_over(name, zero_stage, tp, declared):
    """The capability the layout rules, the mesh and the trainer ask, from the config alone;
    only an optimizer that averages the gradients itself replaces the data-parallel wrapper."""
    from distrain.config.schema import OptimConfig
    from distrain.optim.capability import optimizer_capability

    capability = optimizer_capability(OptimConfig(name=name), zero_stage=zero_stage, tp=tp, pp=1)
    flags = ("exchanges_momentum", "shards_state", "averages_gradients", "shards_gradients")
    assert {flag for flag in flags if getattr(capability, flag)} == declared
    assert capability.replaces_wrapper == bool(
        declared & {"averages_gradients", "shards_gradients"}
    )


@pytest.mark.parametrize("axis", ["tp", "pp"])
def test_onebit_adam_under_tp_or_pp_runs_unwrapped(axis):
    """1-bit Adam under tp or pp averages the local gradients itself (no FSDP2 replicate
    wrapper, which AdamW gets there); only for the optimizer, ZeRO-2's reduce-scatter is not
    on."""
    from distrain.optim.capability import optimizer_capability

    cfg = _config({"optim.name": "onebit_adam", f"parallel.{axis}": "2"})
    dims = validate(cfg, 4).dims
    capability = optimizer_capability(cfg.optim, zero_stage=0, tp=dims.tp, pp=dims.pp)
    assert dims.dp_wrapper == "optimizer" and capability.averages_gradients
    assert not capability.shards_gradients
    assert (dims.dp_replicate, dims.dp_shard) == (2, 1)
    assert validate(_config({f"parallel.{axis}": "2"}), 4).dims.dp_wrapper == "fsdp"


def test_every_tested_layout_passes_the_table():
    """The layouts the parity matrix trains (proved correct there) are not refused."""
    from test_parity import BASE, LAYOUTS

    for layout in LAYOUTS:
        fields = dict(BASE, **layout.fields, **dict(layout.model))
        cfg = load_config(None, overrides(Path("run"), **fields))
        assert validate(cfg, layout.nproc).dims.world_size == layout.nproc, layout.name


def test_auto_micro_batch_on_cuda_defaults_its_budget(cuda_present):
    """On CUDA the budget is the device's memory: auto needs no training.memory_budget_gb; the
    global batch need not be a multiple of an auto micro-batch, only of the data-parallel size."""
    cuda_present(True)
    cfg = _config({"training.micro_batch_size": "auto", "training.global_batch_size": "6"})
    assert cfg.training.micro_batch_size == "auto" and cfg.training.memory_budget_gb is None
    assert validate(cfg, 2).dims.dp_size == 2


def test_unknown_world_size_checks_what_it_can():
    """Elastic MIN:MAX: the world-size rules wait for the workers; the others still refuse."""
    assert validate(_config({"parallel.dp_replicate": "4"}), None).dims is None
    with pytest.raises(LayoutError, match="model.vocab_size"):
        validate(_config({"parallel.tp": "2", "model.vocab_size": "255"}), None)


def test_unknown_preset_is_refused():
    unknown = "model.preset: unknown preset 'huge' of model.family 'gpt'; choose one of"
    with pytest.raises(ConfigError, match=unknown):
        validate(_config({"model.preset": "huge"}), 2)


def test_workers_run_the_table_again(tmp_path):
    """A worker started by anyone's torchrun (here: one process) refuses the same way."""
    with pytest.raises(LayoutError, match=r"parallel.dp_replicate \(2\) must equal"):
        train_in_process(tmp_path / "run", parallel__dp_replicate=2)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


# --- numeric ranges of the schema ---


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("optim.max_grad_norm", "-1",
         "optim.max_grad_norm = -1.0 is out of range: it must be >= 0"),
        ("optim.warmup_steps", "-5", "optim.warmup_steps = -5 is out of range: it must be >= 0"),
        ("optim.beta1", "1.5", "optim.beta1 = 1.5 is out of range: it must be in [0, 1)"),
        ("optim.beta2", "1", "optim.beta2 = 1.0 is out of range: it must be in [0, 1)"),
        ("optim.eps", "0", "optim.eps = 0.0 is out of range: it must be > 0"),
        ("optim.lr", "nan", "optim.lr = nan is out of range: it must be > 0"),
        ("optim.min_lr_ratio", "1.5", "it must be in [0, 1]"),
        ("optim.weight_decay", "-0.1", "it must be >= 0"),
        ("optim.onebit.freeze_step", "-1", "optim.onebit.freeze_step = -1 is out of range"),
        ("data.val_fraction", "1", "data.val_fraction = 1.0 is out of range: it must be in (0, 1)"),
        ("data.max_skew", "2", "it must be in [0, 1]"),
        ("data.max_bytes", "-1", "it must be >= 0"),
        ("training.steps", "0", "training.steps = 0 is out of range: it must be >= 1"),
        ("training.seed", "-1",
         "training.seed = -1 is out of range: it must be in [0, 4294967295]"),
        ("training.eval_interval_steps", "-1", "it must be >= 0"),
        ("model.dim", "0", "model.dim = 0 is out of range: it must be >= 1"),
        ("parallel.dp_replicate", "0",
         "parallel.dp_replicate = 0 is out of range: it must be -1 or >= 1"),
        ("parallel.zero_stage", "4",
         "parallel.zero_stage = 4 is out of range: it must be in [0, 3]"),
        ("parallel.pp_microbatches", "0", "it must be -1 or >= 1"),
        ("comm.powersgd_start_step", "1",
         "it must be >= 2 (DDP rebuilds its buckets after step 1)"),
        ("comm.bucket_cap_mb", "0", "it must be > 0"),
        ("checkpoint.keep_temporary", "0", "it must be >= 1"),
        ("checkpoint.interval_minutes", "inf", "it must be >= 0"),
        ("debug.fail_rank", "-2", "debug.fail_rank = -2 is out of range: it must be -1 or >= 0"),
        ("training.memory_budget_gb", "0",
         "training.memory_budget_gb = 0.0 is out of range: it must be > 0"),
        ("training.micro_batch_size", "0",
         "training.micro_batch_size = 0 is out of range: it must be >= 1"),
        ("training.micro_batch_size", "big",
         "training.micro_batch_size: expected int | auto, got 'big'"),
        ("debug.oom_at_micro_batch", "-1", "it must be >= 0"),
    ],
)  # fmt: skip
def test_out_of_range_number_is_one_line(field, value, expected):
    with pytest.raises(ConfigError) as info:
        load_config(None, parse_overrides([f"--{field}", value]))
    assert expected in str(info.value) and "\n" not in str(info.value)


def test_every_numeric_field_has_a_range_holding_its_default():
    fields = numeric_fields(Config())
    assert len(fields) > 40
    for name, value, f in fields:
        assert "range" in f.metadata, f"{name} has no range: give its doc() one"
        # A field that may be "auto" (micro_batch_size, eval_batches) may default to it.
        assert value in (None, "auto") or value in f.metadata["range"], name


def test_ranges_reject_non_finite_and_edges():
    ranges = {name: f.metadata["range"] for name, _, f in numeric_fields(Config())}
    assert math.nan not in ranges["optim.lr"] and math.inf not in ranges["optim.lr"]
    assert 0.0 in ranges["optim.beta1"] and 1.0 not in ranges["optim.beta1"]
    assert 0.0 not in ranges["data.val_fraction"] and -1 in ranges["parallel.dp_shard"]


def test_help_shows_each_range():
    text = help_text()
    assert "optim.beta1 (float, in [0, 1), default 0.9)" in text
    assert "parallel.dp_replicate (int, -1 or >= 1, default -1)" in text


def test_toml_values_are_range_checked(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[optim]\nmax_grad_norm = -1.0\n")
    with pytest.raises(ConfigError, match="optim.max_grad_norm = -1.0 is out of range"):
        load_config(str(path))


# --- the command line: refused before any worker starts ---


def _main(capsys: pytest.CaptureFixture, *args: str) -> tuple[int, list[str]]:
    rc = cli.main(list(args))
    return rc, capsys.readouterr().err.strip().splitlines()


@pytest.fixture
def no_launch(monkeypatch: pytest.MonkeyPatch) -> list[int | None]:
    """Record, instead of starting, the workers a `distrain train` would launch."""
    launched: list[int | None] = []
    monkeypatch.setattr(
        distrain.launch.torchrun,
        "launch",
        lambda plan, argv, run_dir, checkpoints: launched.append(plan.world_size),
    )
    return launched


def _train_args(run_dir: Path, **fields: str) -> list[str]:
    args = ["train", "--nproc", "2", "--run-dir", str(run_dir)]
    for key, value in {**FAST, **fields}.items():
        args += [f"--{key}", value]
    return args


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"parallel.dp_replicate": "4"}, "parallel.dp_replicate (4) must equal the data-parallel"),
        ({"model.preset": "huge"}, "model.preset: unknown preset 'huge'"),
        ({"data.path": "/nonexistent/corpus.txt"},
         "data.path: no such file or folder '/nonexistent/corpus.txt'"),
        ({"training.seq_len": "4096"}, "training.seq_len (4096) exceeds the model's max_seq_len"),
        ({"optim.beta1": "1.5"}, "optim.beta1 = 1.5 is out of range: it must be in [0, 1)"),
        ({"checkpoint.dir": "nosuch://bucket/run"}, "unknown protocol nosuch://"),
        ({"training.micro_batch_size": "auto"},
         "training.micro_batch_size = 'auto' on CPU needs training.memory_budget_gb"),
        # What the corpus holds decides these (the workers found them, each printing its own).
        ({"data.max_bytes": "2000"},
         "corpus too small for seq_len 128: 2000 tokens give 14 train and 0 validation samples"),
        # Outside --check a missing run secret is refused, not noted as absent.
        ({**FT, "fault_tolerance.secret_file": "/nonexistent/run.secret"},
         "fault_tolerance.secret_file = '/nonexistent/run.secret': No such file or directory"),
        ({"data.max_bytes": "20000", "training.global_batch_size": "1024"},
         "the data set is too small: the training split holds 148 sequences of 128 tokens, one "
         "global batch needs 1024"),
    ],
)  # fmt: skip
def test_train_refuses_before_launch(fields, expected, tmp_path, capsys, no_launch):
    rc, lines = _main(capsys, *_train_args(tmp_path / "run", **fields))
    assert rc == 1 and no_launch == []
    assert lines == [f"distrain: error: {lines[0].removeprefix('distrain: error: ')}"]
    assert expected in lines[0]


def test_a_resume_from_folder_without_a_checkpoint_is_refused_before_launch(
    tmp_path, capsys, no_launch
):
    def train(run: str, resume_from: Path) -> tuple[int, list[str]]:
        fields = {"checkpoint.resume_from": str(resume_from)}
        return _main(capsys, *_train_args(tmp_path / run, **fields))

    missing = tmp_path / "other" / "checkpoints" / "step-00000100"
    rc, lines = train("run", missing)
    assert (rc, no_launch, len(lines)) == (1, [], 1)
    assert f"checkpoint.resume_from = '{missing}': no committed checkpoint there" in lines[0]
    rc, lines = train("run", tmp_path)
    assert (rc, no_launch) == (1, []) and "expected a checkpoint folder named step-" in lines[0]
    # A torn save (no manifest) is no checkpoint either; a committed one launches.
    missing.mkdir(parents=True)
    assert train("run", missing)[0] == 1
    (missing / "MANIFEST.json").write_text("{}")
    assert train("run", missing)[0] == 0
    assert no_launch == [2]
    # A run with a committed checkpoint of its own resumes from it and never reads resume_from.
    own = tmp_path / "run2" / "checkpoints" / "step-00000004"
    own.mkdir(parents=True)
    (own / "MANIFEST.json").write_text("{}")
    assert train("run2", tmp_path / "gone" / "step-00000001")[0] == 0


def test_cuda_requested_without_cuda_is_refused_before_launch(
    tmp_path, capsys, no_launch, cuda_present
):
    cuda_present(False)
    rc, lines = _main(capsys, *_train_args(tmp_path / "run", **{"run.device": "cuda"}))
    assert (rc, no_launch) == (1, []) and len(lines) == 1
    assert "run.device = 'cuda' but CUDA is not available here" in lines[0]


def test_run_dir_that_is_a_file(tmp_path, capsys, no_launch):
    file = tmp_path / "notes.txt"
    file.write_text("x")
    rc, lines = _main(capsys, *_train_args(file))
    assert (rc, no_launch, len(lines)) == (1, [], 1)
    assert f"run.dir '{file}' is a file, not a folder; choose another path" in lines[0]
    rc, lines = _main(capsys, *_train_args(file / "run"))
    assert f"run.dir '{file}/run' cannot be created: '{file}' is a file" in lines[0]
    rc, lines = _main(
        capsys, *_train_args(tmp_path / "run", **{"checkpoint.dir": str(file / "ckpt")})
    )
    assert f"checkpoint.dir '{file}/ckpt' cannot be created: '{file}' is a file" in lines[0]
    assert not (tmp_path / "run").exists()  # preflight leaves nothing behind


def test_elastic_world_size_launches_after_the_rules_it_can_check(tmp_path, capsys, no_launch):
    elastic = ["--nnodes", "1:2", "--rdzv-endpoint", "localhost:29400", "--rdzv-id", "job"]
    fields = {"parallel.dp_replicate": "4"}  # fits a 4-rank attempt: the workers decide
    assert _main(capsys, *_train_args(tmp_path / "a", **fields), *elastic)[0] == 0
    assert no_launch == [None]
    fields = {"parallel.tp": "2", "model.vocab_size": "255"}  # no attempt can run this
    rc, lines = _main(capsys, *_train_args(tmp_path / "b", **fields), *elastic)
    assert rc == 1 and no_launch == [None] and "model.vocab_size" in lines[0]


def test_unknown_command(capsys):
    rc, lines = _main(capsys, "trian")
    assert rc == 2
    assert lines == [
        "distrain: error: unknown command 'trian'; did you mean 'train'? commands: train, "
        "generate, eval, presets, slurm, diagnose, status, plot, prepare, export, plan, "
        "lighthouse, init-config"
    ]


@pytest.mark.parametrize(
    ("option", "value", "expected"),
    [
        ("--max-new-tokens", "0", "--max-new-tokens must be >= 1, got 0"),
        ("--max-new-tokens", "-5", "--max-new-tokens must be >= 1, got -5"),
        (
            "--temperature",
            "-1",
            "--temperature must be a finite number >= 0 (0 = greedy), got -1.0",
        ),
        (
            "--temperature",
            "nan",
            "--temperature must be a finite number >= 0 (0 = greedy), got nan",
        ),
        ("--top-k", "-3", "--top-k must be >= 0 (0 = no top-k filtering), got -3"),
    ],
)
def test_generate_options_are_checked_first(option, value, expected, capsys):
    # The run dir does not exist: the options are checked before anything is loaded.
    rc, lines = _main(capsys, "generate", "--run-dir", "/nonexistent/run", option, value)
    assert (rc, lines) == (1, [f"distrain: error: {expected}"])


# --- real processes: `distrain train` exits before torchrun starts anything ---


def _assert_refused_alone(result: subprocess.CompletedProcess, expected: str) -> None:
    """Exactly one line on stderr (no torchrun banner, no worker's copy) and a failing exit."""
    assert result.returncode == 1, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("distrain: error: "), result.stderr[-2000:]
    assert expected in lines[0]


def test_train_process_refuses_without_starting_workers(tmp_path):
    run = tmp_path / "run"
    result = run_cli(*_train_args(run, **{"parallel.dp_replicate": "4"}), timeout=60)
    _assert_refused_alone(result, "parallel.dp_replicate (4) must equal the data-parallel size 2")
    assert not run.exists()  # no worker ever wrote its log there


def test_object_store_without_its_package(tmp_path):
    # As if s3fs were not installed: importing it fails, as fsspec's registry would find.
    code = "import sys; sys.modules['s3fs'] = None; from distrain.cli import main; sys.exit(main())"
    args = _train_args(tmp_path / "run", **{"checkpoint.dir": "s3://bucket/run"})
    result = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=60
    )
    _assert_refused_alone(
        result, "checkpoint.dir 's3://bucket/run' needs the s3fs package for s3:// URLs; pip "
        "install s3fs"
    )  # fmt: skip


def _unshare_works() -> str:
    """Why a read-only mount cannot be made here ("" when it can)."""
    if shutil.which("unshare") is None:
        return "no unshare command on this machine"
    probe = subprocess.run(
        ["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o ro tmpfs /mnt"],
        capture_output=True,
        text=True,
    )
    return "" if probe.returncode == 0 else f"unshare -rm cannot mount: {probe.stderr.strip()}"


# Runs `distrain train` for each argv given as JSON and prints [rc, stderr] of each as JSON.
_MAIN_EACH = """
import contextlib, io, json, sys
from distrain.cli import main
out = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        out.append([main(argv), err.getvalue()])
print(json.dumps(out))
"""


def test_read_only_folders_are_refused_before_launch(tmp_path):
    """A real read-only filesystem (tmpfs mounted ro in a private mount namespace; root would
    write through any chmod): as run.dir, and as checkpoint.dir. One process for both."""
    reason = _unshare_works()
    if reason:
        pytest.skip(reason)
    ro = tmp_path / "ro"
    ro.mkdir()
    target = ro / "sub"
    argvs = [_train_args(target), _train_args(tmp_path / "run", **{"checkpoint.dir": str(target)})]
    script = f'mount -t tmpfs -o ro tmpfs "{ro}" && exec "$@"'
    result = subprocess.run(
        ["unshare", "-rm", "sh", "-c", script, "sh", sys.executable, "-c", _MAIN_EACH,
         json.dumps(argvs)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    for field, (rc, stderr) in zip(
        ["run.dir", "checkpoint.dir"], json.loads(result.stdout), strict=True
    ):
        assert rc == 1
        assert stderr.splitlines() == [
            f"distrain: error: {field} '{target}' is not writable (Read-only file system "
            f"creating a file in '{ro}'); choose a writable folder"
        ]


def test_worker_entry_does_not_import_the_cli():
    """cli.py imports the worker entry (to run a worker); the worker, the argument parser, the
    layout rules and the preflight must not import cli.py."""
    root = Path(__file__).parent.parent / "distrain"
    for module in ("train/worker.py", "config/args.py", "layout/rules.py", "launch/preflight.py"):
        tree = ast.parse((root / module).read_text())
        imported = {
            node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
        } | {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
             for alias in node.names}  # fmt: skip
        assert "distrain.cli" not in imported, module


def test_a_worker_error_reaches_the_console_once(tmp_path):
    """Each of 2 workers stops on the same non-finite gradient (training.nonfinite = "stop",
    decided inside a step): the launcher prints the first rank's line once (not each rank's),
    and exits with its status; the workers' logs keep it."""
    result = run_cli(
        "train", "--nproc", "2", "--run.dir", str(tmp_path / "run"),
        "--data.max_bytes", "100000", "--training.steps", "4",
        "--training.nonfinite", "stop", "--debug.nan_at_step", "2",
    )  # fmt: skip
    assert result.returncode == 1
    mentions = [line for line in result.stderr.splitlines() if "non-finite" in line]
    assert len(mentions) == 1 and mentions[0].startswith("distrain: error: "), result.stderr
