"""LoRA fine-tuning (parallel/lora.py, the [lora] section): a run trains only its adapters (the
optimizer and the checkpoint hold nothing else), its adapters exported as a PEFT folder give
transformers + peft distrain's logits, its merged export gives transformers them too, and the
same fine-tune on 2 ranks under DDP, FSDP2 (ZeRO-2/3), tp (with and without sequence
parallelism) and pp, and on 4 under ZeRO-3 x tp and tp x pp, has the 1-process run's losses
and trained adapters (so has a fine-tune of each other family's tiny preset under tp and ZeRO-3
or pp), a tp2 fine-tune SIGKILLed after a checkpoint resumes on 1 process
with the uninterrupted run's losses, and of a fine-tune on 2 replica groups one group's worker
SIGKILLed mid-run rejoins with the survivor's adapters and moments (its base comes from
model.init_from, not over the wire), no step lost, the 1-process losses."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers import losses, start_train, train_cli, train_in_process, worker_pid
from replica import (
    PACED_GROUPS,
    check_killed_group_row,
    metrics_rows,
    reaped,
    running_lighthouse,
    secret_file,
    start_groups,
    survivor_ends,
    trained_step,
    wait_until,
)
from test_hf_interop import LOGIT_TOL, RUN, _hf_configs, _hf_logits, _tokens
from test_parity import assert_parity
from test_resume_exact import _kill_when_logged

from distrain.config.schema import ConfigError, LoRAConfig, ModelConfig
from distrain.interop.export import (
    _model_at,
    _run_config,
    export_hf,
    export_peft,
    load_run_model,
)
from distrain.models.decoder.model import Decoder
from distrain.models.registry import model_args, model_family
from distrain.observe.metrics import read_metrics
from distrain.parallel.lora import LoRALinear, apply_lora, is_lora_param, lora_init_value
from distrain.train.rng import rng_state

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

ALL_LINEARS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
LORA = {
    "lora__rank": 4,
    "lora__alpha": 8.0,
    "lora__target_modules": ALL_LINEARS,
    # Large enough steps that the adapters move well away from their init (B = 0).
    "optim__lr": 0.01,
}


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    """A saved random transformers Llama, every weight perturbed (as test_hf_interop's)."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_hf_configs()["llama"])
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    path = tmp_path_factory.mktemp("hf") / "llama"
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def lora_run(llama_dir, tmp_path_factory) -> tuple[Path, dict[int, float]]:
    """(run dir, losses) of a 1-process LoRA fine-tune of the transformers Llama."""
    run = tmp_path_factory.mktemp("lora") / "run"
    rows = train_in_process(
        run, **RUN, **LORA, model__family="llama", model__init_from=f"hf:{llama_dir}"
    )
    return run, losses(rows)


def _checkpoint_keys(run: Path) -> list[str]:
    from torch.distributed.checkpoint import FileSystemReader

    (step,) = sorted((run / "checkpoints").glob("step-*"))[-1:]
    return list(FileSystemReader(str(step)).read_metadata().state_dict_metadata)


def _assert_only_adapters_saved(
    run: Path, adapted: int = 7 * 2, buffers: tuple[str, ...] = ()
) -> None:
    """The checkpoint's model entries and the optimizer's moments are the adapters' alone (2 per
    adapted linear: the Llama's 7 linears x 2 blocks unless `adapted` says otherwise), besides
    the model's persistent `buffers` (state, not weights: Mixtral's expert biases)."""
    keys = _checkpoint_keys(run)
    model_keys = [k for k in keys if k.startswith("model.") and k[6:] not in buffers]
    assert len(model_keys) == 2 * adapted, model_keys
    assert all(k.endswith((".lora_A", ".lora_B")) for k in model_keys), model_keys
    assert {f"model.{b}" for b in buffers} <= set(keys), buffers
    moments = [k for k in keys if k.startswith("optim.") and "exp_avg" in k]
    assert len(moments) == 2 * len(model_keys), moments  # exp_avg and exp_avg_sq of each
    assert all(".lora_" in k for k in moments), moments


def _adapters(run: Path) -> dict[str, torch.Tensor]:
    """The run's adapters at its newest checkpoint, as full tensors by name."""
    cfg, storage = _run_config(run, None)
    model, _ = _model_at(cfg.model, cfg.lora, cfg.training.seed, storage, run, None)
    return {n: p.detach() for n, p in model.named_parameters() if n.endswith(("lora_A", "lora_B"))}


def _base_bytes(run: Path) -> int:
    """The bytes of the run's frozen base weights (fp32)."""
    cfg, storage = _run_config(run, None)
    model, _ = _model_at(cfg.model, cfg.lora, cfg.training.seed, storage, run, None)
    return sum(p.numel() * 4 for n, p in model.named_parameters() if not is_lora_param(n))


def test_only_the_adapters_train_and_are_saved(lora_run):
    """Only the adapters are in the checkpoint and the optimizer, and they moved from their
    init."""
    run, _ = lora_run
    _assert_only_adapters_saved(run)
    assert _adapters(run)["blocks.0.attn.wq.lora_B"].abs().max() > 1e-3


def test_peft_adapter_gives_distrain_logits(lora_run, llama_dir, tmp_path):
    run, _ = lora_run
    out = export_peft(run, tmp_path / "adapter")
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8.0
    assert sorted(config["target_modules"]) == sorted(ALL_LINEARS.split(","))
    base = transformers.AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    tuned = peft.PeftModel.from_pretrained(base, out).eval()
    cfg, storage = _run_config(run, None)
    model, _ = _model_at(cfg.model, cfg.lora, cfg.training.seed, storage, run, None)
    tokens = _tokens()
    with torch.no_grad():
        want = model(tokens)
        got = tuned(tokens).logits
        with tuned.disable_adapter():
            plain = tuned(tokens).logits
    assert (plain - want).abs().max() > 1e-3  # the adapter changes the logits
    print(f"peft vs distrain: max |logit difference| {(got - want).abs().max():.2e}")
    torch.testing.assert_close(got, want, rtol=0, atol=LOGIT_TOL)


def test_merged_export_gives_distrain_logits(lora_run, llama_dir, tmp_path):
    run, _ = lora_run
    """transformers' logits of the merged export (W + scaling B A) equal distrain's of the
    adapted model it trained; load_run_model gives the merged model too."""
    out = export_hf(run, tmp_path / "hf")
    merged, _ = load_run_model(run)
    assert not any(isinstance(m, LoRALinear) for m in merged.modules())
    cfg, storage = _run_config(run, None)
    model, _ = _model_at(cfg.model, cfg.lora, cfg.training.seed, storage, run, None)
    tokens = _tokens()
    with torch.no_grad():
        want = model(tokens)
        torch.testing.assert_close(merged(tokens), want, rtol=0, atol=LOGIT_TOL)
        got = _hf_logits(out, tokens)
        print(f"merged vs distrain: max |logit difference| {(got - want).abs().max():.2e}")
        torch.testing.assert_close(got, want, rtol=0, atol=LOGIT_TOL)
        assert (_hf_logits(llama_dir, tokens) - want).abs().max() > 1e-3


def test_adapters_start_as_peft_makes_them():
    """A is kaiming-uniform within peft's bound 1 / sqrt(in) and B is zero, so the adapted
    model starts as the base model; the names' values differ from one another."""
    a = lora_init_value("blocks.0.attn.wq.lora_A", torch.Size([4, 64]), seed=0)
    assert a.abs().max() <= 1 / 8 and a.abs().max() > 0.1
    assert not torch.equal(a, lora_init_value("blocks.0.attn.wk.lora_A", a.shape, seed=0))
    assert not lora_init_value("blocks.0.attn.wq.lora_B", torch.Size([64, 4]), seed=0).any()


def test_targets_by_hf_or_distrain_name_and_unknown_ones_refused():
    spec = model_family("llama")
    args = model_args(_model_config())
    with torch.device("meta"):
        model = Decoder(args)
    cfg = LoRAConfig(rank=2, target_modules="self_attn.q_proj,wv")
    assert apply_lora(model, spec, args, cfg) == [
        f"blocks.{i}.attn.{w}" for i in range(args.n_layers) for w in ("wq", "wv")
    ]
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {
        f"blocks.{i}.attn.{w}.lora_{ab}"
        for i in range(args.n_layers)
        for w in ("wq", "wv")
        for ab in "AB"
    }
    with torch.device("meta"):
        model = Decoder(args)
    with pytest.raises(ConfigError, match="lora.target_modules: qkv_proj names none"):
        apply_lora(model, spec, args, LoRAConfig(rank=2, target_modules="q_proj,qkv_proj"))


def test_an_moe_router_target_is_refused():
    """Mixtral's router (Hugging Face's block_sparse_moe.gate) is a linear its MoE layer reads
    as a weight: an adapter on it would never train, so naming it is refused; its attention
    takes adapters (FAMILY_LORA's Mixtral targets)."""
    spec = model_family("mixtral")
    args = model_args(ModelConfig(family="mixtral", preset="mixtral-tiny"))
    for target in ("gate", "moe.router"):
        with torch.device("meta"):
            model = Decoder(args)
        with pytest.raises(ConfigError, match=f"{target} names the MoE router blocks.0.moe.router"):
            apply_lora(model, spec, args, LoRAConfig(rank=2, target_modules=f"q_proj,{target}"))
    with torch.device("meta"):
        model = Decoder(args)
    assert len(apply_lora(model, spec, args, LoRAConfig(rank=2, target_modules="q_proj"))) == 2


def _model_config():
    return ModelConfig(family="llama", preset="llama-tiny")


# The layouts LoRA is proven under, (ranks, fields): each of DDP (ZeRO-0/1), FSDP2, tp and pp
# on 2 ranks, and FSDP2 x tp and tp x pp on 4 (layout/rules.py's lora_layouts_proven admits
# them).
LORA_LAYOUTS = {
    "dp2": (2, {}),
    "zero1x2": (2, {"parallel__zero_stage": 1}),
    "zero2x2": (2, {"parallel__zero_stage": 2}),
    "zero3x2": (2, {"parallel__zero_stage": 3}),
    "tp2": (2, {"parallel__tp": 2}),
    "tp2_sp": (2, {"parallel__tp": 2, "parallel__sequence_parallel": True}),
    "pp2": (2, {"parallel__pp": 2}),
    "zero3x2_tp2": (4, {"parallel__zero_stage": 3, "parallel__tp": 2}),
    "tp2_pp2": (4, {"parallel__tp": 2, "parallel__pp": 2}),
}
# Worst |adapter difference| from the 1-process run's after the 4 steps, measured 9e-8 (tp2;
# 6e-8 under ZeRO-2/3, 0 under pp2; the adapters' largest entries are ~5e-3): row-parallel
# partial sums and reduce-scatters add in another order. 1e-6 leaves 10x room. A real bug fails
# the losses already: pp2 with rank 1's lora_B gradients dropped moved them by 5.7e-3 (ZeRO-3
# with the same bug stops with an error).
ADAPTER_ATOL = 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("layout", LORA_LAYOUTS.values(), ids=LORA_LAYOUTS.keys())
def test_lora_layout_matches_one_process(layout, lora_run, llama_dir, tmp_path):
    """The 1-process fine-tune under another layout: the same losses (1e-5 relative, the parity
    matrix's bound) and the same trained adapters, which alone are in the optimizer and the
    checkpoint (under FSDP2 the frozen base is sharded beside them, under tp A and B sit beside
    their base's shards, under pp each stage holds its blocks' adapters)."""
    run, (nproc, fields) = tmp_path / "run", layout
    llama = {"model__family": "llama", "model__init_from": f"hf:{llama_dir}"}
    result = train_cli(run, nproc, **RUN, **LORA, **fields, **llama)
    assert result.returncode == 0, result.stderr[-3000:]
    assert_parity(losses(read_metrics(run / "metrics.jsonl")), lora_run[1])
    _assert_only_adapters_saved(run)
    got, want = _adapters(run), _adapters(lora_run[0])
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=ADAPTER_ATOL, msg=name)


# The other families, each from its seeded tiny preset: (preset, lora.target_modules, adapted
# linears, the layouts it is proven under). Each runs tp2 (its attention split by heads) and the
# layout its own code is likeliest to break under. GPT (no Hugging Face names: distrain's) under
# ZeRO-3; GPT-2 under pp2, its embedding tied across the first and last stage (frozen: the tied
# gradients are zeros) and its learned positions on the first, targeted by distrain's names for
# the query, key and value its fused c_attn holds and by Hugging Face's Conv1D names (c_proj
# names both the attention's and the MLP's output); Qwen3 (query/key norms, heads wider than
# dim / n_heads, tied embeddings) under ZeRO-3; Mixtral under pp2 (the MoE blocks' balancing
# losses per stage). Mixtral's experts are stacked 3-D weights, not linears, and its router is
# read as a weight by the MoE layer: LoRA adapts its attention only. Worst |adapter difference|
# from the family's 1-process run measured 2e-7 (qwen3 ZeRO-3; 1e-7 to 2e-7 under tp2, 0 under
# pp2; the largest B entries are 5e-3): within ADAPTER_ATOL with 5x room.
FAMILY_LORA = {
    "gpt": ("tiny", "wq,wk,wv,wo,w_up,w_down", 6 * 4, ("tp2", "zero3x2")),
    "gpt2": ("gpt2-tiny", "attn.wq,attn.wk,attn.wv,c_proj,c_fc", 6 * 2, ("tp2", "pp2")),
    "qwen3": ("qwen3-tiny", ALL_LINEARS, 7 * 2, ("tp2", "zero3x2")),
    "mixtral": ("mixtral-tiny", "q_proj,k_proj,v_proj,o_proj", 4 * 2, ("tp2", "pp2")),
}


def _family_fields(family: str) -> dict:
    preset, targets, _, _ = FAMILY_LORA[family]
    return {
        **RUN,
        **LORA,
        "lora__target_modules": targets,
        "model__family": family,
        "model__preset": preset,
    }


@pytest.fixture(scope="module")
def family_lora_runs(tmp_path_factory) -> Callable[[str], tuple[Path, dict[int, float]]]:
    """family -> (run dir, losses) of a 1-process LoRA fine-tune of the family's seeded tiny
    preset, made once per family (a module-scoped fixture parametrized with (family, layout)
    pairs would be set up again for each pair)."""
    runs: dict[str, tuple[Path, dict[int, float]]] = {}

    def reference(family: str) -> tuple[Path, dict[int, float]]:
        if family not in runs:
            run = tmp_path_factory.mktemp(f"lora_{family}") / "run"
            runs[family] = run, losses(train_in_process(run, **_family_fields(family)))
        return runs[family]

    return reference


@pytest.mark.slow
@pytest.mark.parametrize(
    "family,layout",
    [(f, layout) for f, (*_, layouts) in FAMILY_LORA.items() for layout in layouts],
    ids=[f"{f}-{layout}" for f, (*_, layouts) in FAMILY_LORA.items() for layout in layouts],
)
def test_lora_family_layout_matches_one_process(family, layout, family_lora_runs, tmp_path):
    """As test_lora_layout_matches_one_process, for each other family under its layouts: the
    1-process run's losses (1e-5 relative) and trained adapters (ADAPTER_ATOL), which alone are
    in the optimizer and the checkpoint."""
    reference, want_losses = family_lora_runs(family)
    run, (nproc, fields) = tmp_path / "run", LORA_LAYOUTS[layout]
    result = train_cli(run, nproc, **_family_fields(family), **fields)
    assert result.returncode == 0, result.stderr[-3000:]
    assert_parity(losses(read_metrics(run / "metrics.jsonl")), want_losses)
    buffers = tuple(f"blocks.{i}.moe.expert_bias" for i in range(2)) if family == "mixtral" else ()
    _assert_only_adapters_saved(run, adapted=FAMILY_LORA[family][2], buffers=buffers)
    got, want = _adapters(run), _adapters(reference)
    assert got.keys() == want.keys()
    assert max(t.abs().max() for n, t in want.items() if n.endswith("lora_B")) > 1e-3  # trained
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=ADAPTER_ATOL, msg=name)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_adapters_sit_beside_tp_shards(sequence_parallel):
    """Under tp's styles (here on a 1-rank mesh: the DTensor code paths, not the split), A and
    B are placed as their base weight asks, the base stays frozen (sequence parallelism makes
    new norm weights), and the logits and gradients are those of the plain adapted model."""
    from helpers import process_group
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    from distrain.models.decoder.model import init_weights
    from distrain.parallel.lora import frozen_names, init_lora, place_lora_under_tp
    from distrain.parallel.tensor import apply_tensor_parallel

    spec, args = model_family("llama"), model_args(_model_config())
    cfg = LoRAConfig(rank=4, target_modules=ALL_LINEARS)
    want_model = Decoder(args)
    apply_lora(want_model, spec, args, cfg)
    init_weights(want_model, args, 0)
    init_lora(want_model, 0)
    with torch.no_grad():
        for name, p in want_model.named_parameters():
            if name.endswith("lora_B"):
                p.normal_()
    tokens = _tokens(seq=16)
    with process_group():
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
        with torch.device("meta"):
            model = Decoder(args)
        apply_lora(model, spec, args, cfg)
        frozen = frozen_names(model)
        apply_tensor_parallel(model, mesh["tp"], sequence_parallel=sequence_parallel, spec=spec)
        place_lora_under_tp(model, frozen)
        model.to_empty(device="cpu")
        init_weights(model, args, 0)
        init_lora(model, 0)
        wq, w_down = model.blocks["0"].attn.wq, model.blocks["0"].mlp.w_down
        assert (wq.lora_A.placements, wq.lora_B.placements) == ((Replicate(),), (Shard(0),))
        assert (w_down.lora_A.placements, w_down.lora_B.placements) == ((Shard(1),), (Replicate(),))
        with torch.no_grad():
            for (name, p), q in zip(model.named_parameters(), want_model.parameters(), strict=True):
                if name.endswith("lora_B"):
                    p.to_local().copy_(q)
        got = model(tokens)
        got = got.full_tensor() if hasattr(got, "full_tensor") else got
        want = want_model(tokens)
        torch.testing.assert_close(got, want, rtol=0, atol=LOGIT_TOL)
        got.sum().backward()
        want.sum().backward()
        trained = {n for n, p in model.named_parameters() if p.grad is not None}
        assert trained == {n for n, p in want_model.named_parameters() if p.requires_grad}
        grad = model.blocks["1"].mlp.w_down.lora_A.grad.full_tensor()
        torch.testing.assert_close(grad, want_model.blocks["1"].mlp.w_down.lora_A.grad)


def test_a_frozen_tied_embedding_gets_no_gradient_across_stages():
    """Under pp a tied embedding's two stage copies sum their gradients after each backward; a
    LoRA run's are frozen, so the sum skips them: no [vocab, dim] of zeros is made, sent and
    left as the frozen weight's gradient."""
    import torch.distributed as dist
    from helpers import process_group

    from distrain.parallel.tied import TiedEmbedding

    with process_group():
        stage = torch.nn.Embedding(8, 4).requires_grad_(False)
        tied = TiedEmbedding([stage], [0], 2, dist.group.WORLD, names=("weight", "weight"))
        tied.sum_gradients()
        assert stage.weight.grad is None


@pytest.mark.slow
def test_a_killed_tp2_fine_tune_resumes_on_one_process(llama_dir, tmp_path):
    """A tp2 fine-tune checkpointing every 2 steps, its rank 1 SIGKILLed from outside once step
    3 is logged (no restart: the job fails), resumes from its adapters' checkpoint (split by tp)
    on 1 process, and its losses before and after the resume are the uninterrupted 1-process
    run's (1e-5 relative, the parity bound: the steps before the kill ran under tp)."""
    fields = {
        **RUN,
        **LORA,
        "training__steps": 6,
        "checkpoint__interval_steps": 2,
        "model__family": "llama",
        "model__init_from": f"hf:{llama_dir}",
    }
    want = losses(train_in_process(tmp_path / "uninterrupted", **fields))
    run = tmp_path / "run"
    agent = start_train(run, "--nproc", "2", **fields, parallel__tp=2)
    try:
        _kill_when_logged(agent, run, rank=1, after_step=3)
        _, stderr = agent.communicate(timeout=300)
    finally:
        if agent.poll() is None:
            agent.kill()
    assert agent.returncode != 0, stderr[-3000:]
    rows = train_in_process(run, **fields)
    (resumed,) = [r["resumed_from"] for r in rows if "resumed_from" in r]
    assert resumed in (2, 4), rows
    assert all(r.get("attempt") for r in rows if "loss" in r and r["step"] > resumed), rows
    # The stitched curve: steps up to the checkpoint from the tp2 run, the rest resumed.
    assert_parity(losses(rows), want)


# --- replica groups -----------------------------------------------------------------------------

GROUP_STEPS = 24
# Two groups of 1 rank each add their halves of the global batch in another order than the
# 1-process run: test_replica_groups.py's bound for the same setting.
GROUP_REL = 1e-6
GROUP_FIELDS = {
    **RUN,
    **LORA,
    "training__steps": GROUP_STEPS,
    "training__deterministic": True,
    "model__family": "llama",
}
REPLICA_FIELDS = {**PACED_GROUPS, "debug__slow_ms": 800}


@pytest.fixture(scope="module")
def lora_groups(llama_dir, tmp_path_factory) -> dict:
    """A LoRA fine-tune of the Llama on 2 replica groups of 1 rank (ZeRO-3), and the same
    fine-tune uninterrupted on 1 process. Once both groups have logged step 3, group 1's worker
    is SIGKILLed from outside; its torchrun restarts it and it rejoins with group 0's live
    state. Group 0 is never touched."""
    pytest.importorskip("torchft")
    root = tmp_path_factory.mktemp("lora_groups")
    fields = {**GROUP_FIELDS, "model__init_from": f"hf:{llama_dir}"}
    reference = root / "reference"
    train_in_process(reference, **fields)
    runs = [root / f"group{g}" for g in range(2)]
    secret = secret_file(root)
    with running_lighthouse() as lighthouse:
        procs = start_groups(runs, lighthouse, secret, max_restarts=2, **fields, **REPLICA_FIELDS)
        with reaped(procs):
            wait_until(
                lambda: min(trained_step(r) for r in runs) >= 3, "step 3 in both groups", procs, 240
            )
            survivor = worker_pid(procs[0].pid, 0, restart=0)
            os.kill(worker_pid(procs[1].pid, 0, restart=0), signal.SIGKILL)
            # Group 1 trains the last steps beside group 0 and ends with it.
            err0 = survivor_ends(procs, timeout_s=300, others_s=60)
    assert procs[0].returncode == 0, err0[-4000:]
    return {"runs": runs, "reference": reference, "survivor": survivor}


@pytest.mark.slow
def test_lora_replica_group_killed_rejoins_with_the_survivors_adapters(lora_groups):
    """The survivor trains every step once without a restart, each loss the 1-process run's
    (GROUP_REL); the killed group rejoins with a transfer of the adapters and their moments
    only (the frozen base is made again from model.init_from), and logs every step after it
    with the 1-process run's loss: the groups' mean, to which its half of the batch through its
    own base weights and adapters contributes (a base or adapter unlike the survivor's moves it,
    and both groups' updates); both groups end with bit-identical adapters, the 1-process
    run's within ADAPTER_ATOL."""
    (run0, run1), reference = lora_groups["runs"], lora_groups["reference"]
    assert lora_groups["survivor"] is not None
    rows0 = read_metrics(run0 / "metrics.jsonl", all_attempts=True)
    assert not any("attempt" in r or "resumed_from" in r for r in rows0)
    assert [r["step"] for r in rows0 if "loss" in r] == list(range(1, GROUP_STEPS + 1))
    check_killed_group_row(metrics_rows(run0), ranks_lost="1")
    want = losses(read_metrics(reference / "metrics.jsonl"))
    rows1 = read_metrics(run1 / "metrics.jsonl", all_attempts=True)
    (rejoined, *_) = [r for r in metrics_rows(run1) if r.get("replica_change") == "rejoined"]
    # Steps group 1 trained after taking the live state: every one up to the end.
    after = {r["step"]: r["loss"] for r in rows1 if "loss" in r and r["step"] > rejoined["step"]}
    assert sorted(after) == list(range(rejoined["step"] + 1, GROUP_STEPS + 1)), rejoined
    for got in (losses(rows0), after):
        for step, loss in got.items():
            assert abs(loss - want[step]) <= GROUP_REL * abs(want[step]), (step, loss, want[step])
    got, replacement, one = _adapters(run0), _adapters(run1), _adapters(reference)
    assert got.keys() == replacement.keys() == one.keys()
    for name in one:
        assert torch.equal(replacement[name], got[name]), name
        torch.testing.assert_close(got[name], one[name], rtol=0, atol=ADAPTER_ATOL, msg=name)
    # What went over the wire, to the byte: the adapters, Adam's two moments and step count of
    # each, the RNG states, the loader position and the trainer's step; not the frozen base.
    adapter_bytes = sum(t.numel() * t.element_size() for t in one.values())
    rng_bytes = sum(t.numel() * t.element_size() for t in rng_state().values())
    counters = 4 * len(one) + rng_bytes + 8 + 8  # Adam's fp32 steps; int64 position and step
    assert rejoined["state_mb"] * 2**20 == 3 * adapter_bytes + counters, rejoined
    assert _base_bytes(reference) > 10 * adapter_bytes  # the base alone would dwarf it
