"""Hugging Face interop of the llama, gpt2, qwen3 and mixtral families (each imports and exports
the transformers architecture of its name), against transformers itself.

Tiny random transformers models are built and saved locally (nothing is downloaded):
- imported with `model.init_from`, distrain's logits equal transformers' (fp32, 1e-5);
- training from them under dp2 (ZeRO-3), tp2 (sequence parallel, grouped-query attention) and
  pp2 reproduces the 1-process loss curve (the parity matrix's 1e-5), each run's checkpoint is
  exported with `distrain export --format hf`, and transformers' logits of the export equal
  distrain's logits of the checkpoint;
- a torch.export program of a checkpoint gives the eager model's logits;
- presets' parameter counts equal those of transformers models built from the published configs.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import struct
from pathlib import Path

import pytest
import torch
from batch import Batches, Run, selected
from helpers import losses, train_in_process
from test_parity import assert_parity

from distrain.cli import main
from distrain.config.schema import ConfigError, ModelConfig
from distrain.interop.export import export_hf, load_run_model
from distrain.models.decoder.model import Decoder, init_weights
from distrain.models.llama.hf import pretrained_source
from distrain.models.registry import model_args, model_family
from distrain.observe.metrics import read_metrics

# In the compat suite (.ci/run: also on the oldest and newest torch): the HF round trip.
pytestmark = pytest.mark.compat

transformers = pytest.importorskip("transformers")

# Logits of the same fp32 weights through the same math; measured differences <= 5e-7.
LOGIT_TOL = 1e-5
SEQ = 32
RUN = {
    "training__steps": 4,
    "training__global_batch_size": 8,
    "training__micro_batch_size": 2,
    "training__seq_len": SEQ,
    "checkpoint__interval_steps": 0,
    "checkpoint__at_end": True,
}


def _hf_configs() -> dict[str, object]:
    """Tiny members of each family. Llama: grouped-query attention (4 query heads, 2 key/value)
    and Llama 3 rotary scaling whose original context (16) is shorter than the sequences, so the
    scaled frequencies matter; untied, so the pipeline can split it."""
    return {
        "llama": transformers.LlamaConfig(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=192,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
            tie_word_embeddings=False,
        ),
        "gpt2": transformers.GPT2Config(
            vocab_size=256,
            n_positions=64,
            n_embd=64,
            n_layer=2,
            n_head=4,
            bos_token_id=0,
            eos_token_id=0,
        ),
        # Heads wider than hidden / heads (32 x 4 on a 64 stream), as every Qwen3's; tied, as
        # the small ones are, so tp and pp split a shared embedding and head.
        "qwen3": transformers.Qwen3Config(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=192,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            max_position_embeddings=64,
            rope_theta=1_000_000.0,
            tie_word_embeddings=True,
        ),
        # 4 experts of 96, 2 per token, in every block; untied.
        "mixtral": transformers.MixtralConfig(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            max_position_embeddings=64,
            rope_theta=1_000_000.0,
        ),
    }


def _imported(arch: str, folder: Path):
    """(args, model) of the transformers folder of architecture `arch`, imported."""
    spec = f"hf:{folder}"
    args = model_args(ModelConfig(family=arch, init_from=spec))
    model = Decoder(args)
    init_weights(model, args, seed=0, source=model_family(arch).hf.source(spec, args))
    return args, model


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    """family -> a saved random transformers model whose every weight (norm weights and biases
    too, which start at 1 and 0) is perturbed, so a mis-mapped tensor shows in the logits."""
    root = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    dirs = {}
    for family, config in _hf_configs().items():
        model = transformers.AutoModelForCausalLM.from_config(config)
        with torch.no_grad():
            for param in model.parameters():
                param.add_(torch.randn_like(param) * 0.05)
        model.save_pretrained(root / family)
        dirs[family] = root / family
    return dirs


def _hf_logits(path: Path, tokens: torch.Tensor) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(tokens).logits


def _tokens(batch: int = 2, seq: int = SEQ) -> torch.Tensor:
    return torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen3", "mixtral"])
def test_import_gives_transformers_logits(family, hf_dirs):
    args, model = _imported(family, hf_dirs[family])
    tokens = _tokens()
    want = _hf_logits(hf_dirs[family], tokens)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), want, rtol=0, atol=LOGIT_TOL)
    if family == "llama":
        # The Llama 3 scaling is read and applied: without it the logits move far off.
        assert args.rope_scaling_factor == 8.0 and args.rope_original_max_seq_len == 16
        args.rope_scaling_factor = 1.0
        unscaled = Decoder(args)
        unscaled.load_state_dict(model.state_dict())
        with torch.no_grad():
            assert (unscaled(tokens) - want).abs().max() > 100 * LOGIT_TOL
    if family == "qwen3":
        # The query and key heads' norms are read and applied: without them the logits move.
        assert args.qk_norm and args.head_dim == 32 and args.q_dim == 128
        with torch.no_grad():
            for block in model.blocks.values():
                block.attn.q_norm.weight.fill_(1.0)
            assert (model(tokens) - want).abs().max() > 100 * LOGIT_TOL
    if family == "mixtral":
        # Every expert is read in its place: two experts swapped move the logits.
        assert args.moe.num_experts == 4 and args.moe.top_k == 2
        with torch.no_grad():
            up = model.blocks["0"].moe.experts.w_up
            up.copy_(up[[1, 0, 2, 3]])
            assert (model(tokens) - want).abs().max() > 100 * LOGIT_TOL


def test_each_family_imports_only_its_own_folders(hf_dirs):
    with pytest.raises(ConfigError, match="model_type 'llama'; model.family = 'qwen3' imports"):
        model_args(ModelConfig(family="qwen3", init_from=f"hf:{hf_dirs['llama']}"))
    with pytest.raises(ConfigError, match="model_type 'qwen3'; model.family = 'llama' imports"):
        model_args(ModelConfig(family="llama", init_from=f"hf:{hf_dirs['qwen3']}"))
    with pytest.raises(ConfigError, match="model_type 'llama'; model.family = 'gpt2' imports"):
        model_args(ModelConfig(family="gpt2", init_from=f"hf:{hf_dirs['llama']}"))
    # The gpt family (every setting of the decoder open) has no Hugging Face equivalent.
    with pytest.raises(ConfigError, match="model.family 'gpt' reads no Hugging Face folder"):
        model_args(ModelConfig(init_from=f"hf:{hf_dirs['llama']}"))
    assert model_family("gpt").hf is None
    with pytest.raises(ConfigError, match="model_type 'qwen3'; model.family = 'mixtral' imports"):
        model_args(ModelConfig(family="mixtral", init_from=f"hf:{hf_dirs['qwen3']}"))


def test_import_refusals_are_one_line(tmp_path, hf_dirs):
    with pytest.raises(ConfigError, match=r"^model.init_from: no config.json in .*folder written"):
        model_args(ModelConfig(family="llama", init_from=f"hf:{tmp_path}"))
    with pytest.raises(ConfigError, match="expected 'hf:DIR'"):
        model_args(ModelConfig(family="llama", init_from=str(hf_dirs["llama"])))
    args = model_args(ModelConfig(family="llama", init_from=f"hf:{hf_dirs['llama']}", n_layers=3))
    model = Decoder(args)
    with pytest.raises(ConfigError, match="has no tensor 'model.layers.2.input_layernorm.weight'"):
        init_weights(model, args, 0, source=pretrained_source(f"hf:{hf_dirs['llama']}", args))


@pytest.mark.parametrize(
    ("index", "refusal"),
    [
        ({"weight_map": {"lm_head.weight": "../../outside.safetensors"}}, "not a file in"),
        ({"weight_map": {"lm_head.weight": "/etc/passwd"}}, "not a file in"),
        ({"weight_map": ["x"]}, "is not a safetensors index"),
        ({"no": "map"}, "is not a safetensors index"),
    ],
    ids=["dotdot", "absolute", "list", "missing"],
)
def test_a_hostile_safetensors_index_is_refused(tmp_path, hf_dirs, index, refusal):
    folder = tmp_path / "hf"
    shutil.copytree(hf_dirs["llama"], folder)
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    args = model_args(ModelConfig(family="llama", init_from=f"hf:{folder}"))
    with pytest.raises(ConfigError, match=refusal) as refused:
        init_weights(Decoder(args), args, 0, source=pretrained_source(f"hf:{folder}", args))
    assert "\n" not in str(refused.value)


_QWEN3 = {"vocab_size": 151936, "head_dim": 128, "num_key_value_heads": 8}

# Published configurations (values from the models' config.json files), built locally; by
# (family, preset).
PUBLISHED = {
    ("gpt2", "gpt2"): ("GPT2Config", {}),
    ("gpt2", "gpt2-medium"): ("GPT2Config", {"n_embd": 1024, "n_layer": 24, "n_head": 16}),
    ("llama", "llama3-1b"): (
        "LlamaConfig",
        {
            "vocab_size": 128256,
            "hidden_size": 2048,
            "intermediate_size": 8192,
            "num_hidden_layers": 16,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "tie_word_embeddings": True,
        },
    ),
    ("llama", "llama3-8b"): (
        "LlamaConfig",
        {
            "vocab_size": 128256,
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
        },
    ),
    ("llama", "llama2-7b"): ("LlamaConfig", {}),
    ("qwen3", "qwen3-0.6b"): (
        "Qwen3Config",
        {
            **_QWEN3,
            "hidden_size": 1024,
            "intermediate_size": 3072,
            "num_hidden_layers": 28,
            "num_attention_heads": 16,
            "tie_word_embeddings": True,
        },
    ),
    ("mixtral", "mixtral-8x7b"): (
        "MixtralConfig",
        {
            "vocab_size": 32000,
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
        },
    ),
    ("qwen3", "qwen3-8b"): (
        "Qwen3Config",
        {
            **_QWEN3,
            "hidden_size": 4096,
            "intermediate_size": 12288,
            "num_hidden_layers": 36,
            "num_attention_heads": 32,
            "tie_word_embeddings": False,
        },
    ),
}


def test_presets_have_published_parameter_counts(capsys):
    assert main(["presets"]) == 0
    printed = {
        tuple(line.split()[:2]): int(line.split()[2].replace(",", ""))
        for line in capsys.readouterr().out.splitlines()[1:]
    }
    for (family, name), (config_class, fields) in PUBLISHED.items():
        config = getattr(transformers, config_class)(**fields)
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
        published = sum(p.numel() for p in model.parameters())  # a tied head counts once
        spec = model_family(family)
        assert printed[family, name] == spec.num_params(spec.presets[name]) == published, name


@pytest.mark.parametrize(
    ("family", "name"),
    [
        ("gpt2", "gpt2"),
        ("gpt2", "gpt2-tiny"),
        ("llama", "llama3-1b"),
        ("llama", "llama2-7b"),
        ("llama", "llama-tiny"),
        ("qwen3", "qwen3-tiny"),
        ("qwen3", "qwen3-8b"),
        ("mixtral", "mixtral-tiny"),
        ("mixtral", "mixtral-8x7b"),
    ],
)
def test_exported_config_reads_back(family, name, tmp_path):
    """config.json as export writes it: transformers builds a model of the preset's size from it,
    and importing it gives the preset's shape back (rotary scaling included)."""
    spec = model_family(family)
    preset = spec.presets[name]
    (tmp_path / "config.json").write_text(json.dumps(spec.hf.config(preset, dtype=torch.float32)))
    config = transformers.AutoConfig.from_pretrained(tmp_path)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    assert sum(p.numel() for p in model.parameters()) == spec.num_params(preset)
    back = model_args(ModelConfig(family=family, init_from=f"hf:{tmp_path}"))
    # n_kv_heads None and n_heads are one shape.
    assert dataclasses.replace(back, n_kv_heads=back.kv_heads) == dataclasses.replace(
        preset, n_kv_heads=preset.kv_heads
    )


@pytest.fixture(scope="module")
def references(hf_dirs, tmp_path_factory) -> dict[str, tuple[Path, dict[int, float]]]:
    """family -> (run dir, loss curve) of 1-process fine-tuning from the transformers model."""
    out = {}
    for family, path in hf_dirs.items():
        run = tmp_path_factory.mktemp(f"ref-{family}") / "run"
        rows = train_in_process(
            run,
            **dict(RUN, checkpoint__interval_steps=2),
            model__family=family,
            model__init_from=f"hf:{path}",
        )
        out[family] = (run, losses(rows))
    return out


def test_fine_tuning_logs_what_it_loaded(references, hf_dirs):
    """Under model.init_from the model's log line names the family, the folder and the
    parameter count, not the preset it ignores."""
    run, _ = references["llama"]
    log = (run / "logs" / "rank0.log").read_text()
    assert re.search(rf"model llama from hf:{re.escape(str(hf_dirs['llama']))}: [0-9.]+M par", log)


def _assert_export_matches(run: Path, out: Path, **options) -> None:
    """transformers' logits of the export equal distrain's logits of the checkpoint."""
    export_hf(run, out, **options)
    model, _ = load_run_model(run)
    tokens = _tokens()
    with torch.no_grad():
        torch.testing.assert_close(_hf_logits(out, tokens), model(tokens), rtol=0, atol=LOGIT_TOL)


# (name, family, ranks, layout overrides): few rows, each covering much; every family once
# under tp x pp (sequence parallel on, a pipeline of 1F1B).
TP2_PP2 = {"parallel__tp": 2, "parallel__pp": 2, "parallel__pp_schedule": "1f1b"}
HF_LAYOUTS = [
    ("dp2_zero3", "gpt2", 2, {"parallel__zero_stage": 3}),
    ("tp2_pp2_gpt2", "gpt2", 4, TP2_PP2),
    ("tp2_pp2_llama_gqa", "llama", 4, TP2_PP2),
    ("tp2_pp2_qwen3", "qwen3", 4, {"parallel__tp": 2, "parallel__pp": 2}),
    ("ep2_zero3_mixtral", "mixtral", 2, {"parallel__ep": 2, "parallel__zero_stage": 3}),
    ("tp2_pp2_mixtral", "mixtral", 4, {"parallel__tp": 2, "parallel__pp": 2}),
]


@pytest.fixture(scope="module")
def batched(hf_dirs, request, tmp_path_factory):
    """The run dir of a layout's fine-tuning run, once it trained without error. The layouts
    this session selected train in one torchrun launch per world size (tests/batch.py)."""
    runs = {
        f"test_fine_tune_under_layout_matches_and_exports[{name}]": Run(
            nproc,
            dict(
                RUN,
                **fields,
                model__family=family,
                model__init_from=f"hf:{hf_dirs[family]}",
            ),
        )
        for name, family, nproc, fields in HF_LAYOUTS
    }
    batches = Batches(selected(runs, request.session.items), tmp_path_factory.mktemp("batched"))

    def run_dir(name: str) -> Path:
        outcome = batches.result(name)
        assert outcome.error is None, outcome.error
        return outcome.run_dir

    return run_dir


@pytest.mark.slow
@pytest.mark.parametrize(
    "family", [layout[1] for layout in HF_LAYOUTS], ids=[layout[0] for layout in HF_LAYOUTS]
)
def test_fine_tune_under_layout_matches_and_exports(family, references, batched, request, tmp_path):
    run = batched(request.node.name)
    assert_parity(losses(read_metrics(run / "metrics.jsonl")), references[family][1])
    # A small shard limit makes several shards, so the index is exercised.
    _assert_export_matches(run, tmp_path / "hf", shard_mb=0.05)
    assert len(list((tmp_path / "hf").glob("model-*-of-*.safetensors"))) > 1


def _safetensors_dtypes(path: Path) -> set[str]:
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    return {v["dtype"] for k, v in header.items() if k != "__metadata__"}


def test_export_cli_step_and_dtype(references, tmp_path):
    run, _ = references["gpt2"]
    out = tmp_path / "bf16"
    argv = ["export", str(run), "--format", "hf", "--out", str(out), "--step", "2"]
    assert main([*argv, "--dtype", "bf16"]) == 0
    assert set().union(*map(_safetensors_dtypes, out.glob("*.safetensors"))) == {"BF16"}
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "gpt2" and config["torch_dtype"] == "bfloat16"
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    at_2, step = load_run_model(run, step=2)
    latest, _ = load_run_model(run)
    assert step == 2
    wte = hf.transformer.wte.weight
    assert torch.equal(wte, at_2.tok_emb.weight.to(torch.bfloat16))
    assert not torch.equal(wte, latest.tok_emb.weight.to(torch.bfloat16))
    assert main([*argv[:-1], "9", "--out", str(tmp_path / "none")]) != 0


def test_torch_export_program_gives_eager_logits(references, tmp_path):
    run, _ = references["llama"]
    path = tmp_path / "llama.pt2"
    assert main(["export", str(run), "--format", "torch-export", "--out", str(path)]) == 0
    program = torch.export.load(str(path)).module()
    model, _ = load_run_model(run)
    with torch.no_grad():
        for batch, seq in [(2, SEQ), (1, 5), (3, 64)]:
            tokens = _tokens(batch, seq)
            # The same ops traced: equal up to kernel choice (measured: bit-identical).
            torch.testing.assert_close(program(tokens), model(tokens), rtol=0, atol=1e-6)
