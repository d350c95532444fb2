"""Chat and instruction data: `distrain prepare` of conversations (`messages`, prompt/completion)
rendered with the tokenizer folder's chat template, the stored loss mask (the assistant's answers),
and fine-tuning on it, against TRL's SFTTrainer and across layouts.

All local: a byte-level BPE with ChatML tokens and a tiny random llama, built here.
- the mask stored by prepare is the assistant's answers (checked by decoding, not by the code
  that made it); a folder without a chat template is refused in one line;
- the first step's loss, and the tokens it counts, equal TRL's SFTTrainer's on the same
  conversations (same template, same masking; its padded batch of whole conversations, ours the
  same conversations packed into one sequence with document masking): within 1e-5;
- the same fine-tune on 1 process, dp2, tp2 and pp2 has the same losses (1e-5).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from batch import Batches, Run, selected
from helpers import losses, train_in_process
from test_parity import assert_parity

from distrain.config.schema import DataConfig
from distrain.data import DataError, DistributedBatchLoader, build_datasets
from distrain.data.prepare import prepare
from distrain.data.tokfile import mask_path, read_sidecar
from distrain.errors import ConfigError
from distrain.observe.metrics import read_metrics

transformers = pytest.importorskip("transformers")

# ChatML, the assistant's answer and its end-of-turn token inside generation markers (what
# transformers' assistant mask and TRL's assistant_only_loss read).
TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{% generation %}{{- message['content'] + '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}"
    "{%- else %}{{- message['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
PLAIN_TEMPLATE = TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")
WORDS = "the cat sat on a mat and saw one red fox run over two big logs by the old river".split()


def _text(rng: np.random.Generator, n: int) -> str:
    return " ".join(rng.choice(WORDS, size=n))


def conversations(count: int, seed: int = 0) -> list[dict]:
    """`count` records: multi-turn `messages` (some with a system turn), and prompt/completion
    pairs, both as strings and as TRL's conversational lists."""
    rng = np.random.default_rng(seed)
    out: list[dict] = []
    for i in range(count):
        messages = [{"role": "system", "content": _text(rng, 3)}] if i % 3 == 0 else []
        for _ in range(1 + i % 2):
            messages += [
                {"role": "user", "content": _text(rng, int(rng.integers(2, 7)))},
                {"role": "assistant", "content": _text(rng, int(rng.integers(2, 9)))},
            ]
        out.append({"messages": messages})
    return out


@pytest.fixture(scope="module")
def chat_tok(tmp_path_factory) -> Path:
    """A folder with a byte-level BPE (ChatML special tokens) and TEMPLATE as its chat
    template, as save_pretrained writes it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([" ".join(WORDS)] * 50 + ["user assistant system"] * 20, trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = TEMPLATE
    folder = tmp_path_factory.mktemp("chat-tok")
    fast.save_pretrained(folder)
    return folder


def _write(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _prepared(out: Path) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(tokens, mask) of each conversation of a prepared file."""
    tokens = np.fromfile(out, dtype=read_sidecar(out).dtype)
    mask = np.fromfile(mask_path(out), dtype=np.uint8)
    bounds = np.load(out.with_name(out.name + ".docs.npy"))
    return (
        [tokens[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)],
        [mask[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)],
    )


def _assistant(record: dict) -> list[dict]:
    return [m for m in record["messages"] if m["role"] == "assistant"]


def _counted_text(tok, tokens: np.ndarray, mask: np.ndarray) -> list[str]:
    """The decoded runs of counted tokens."""
    runs, run = [], []
    for t, m in zip(tokens.tolist(), mask.tolist(), strict=True):
        if m:
            run.append(t)
        elif run:
            runs.append(tok.decode(run))
            run = []
    if run:
        runs.append(tok.decode(run))
    return runs


def test_prepare_stores_the_assistant_answers_as_the_loss_mask(chat_tok, tmp_path) -> None:
    tok = transformers.AutoTokenizer.from_pretrained(chat_tok)
    spec = f"hf:{chat_tok}"
    records = conversations(12)
    out = tmp_path / "m.bin"
    result = prepare([str(_write(tmp_path / "m.jsonl", records))], out=str(out), tokenizer=spec,
                     workers=2)  # fmt: skip
    assert result.sidecar.loss_mask == "m.bin.mask" and result.sidecar.num_documents == 12
    docs, masks = _prepared(out)
    for record, tokens, mask in zip(records, docs, masks, strict=True):
        assert tok.decode(tokens) == tok.apply_chat_template(record["messages"], tokenize=False)
        answers = [m["content"] + "<|im_end|>" for m in _assistant(record)]
        assert _counted_text(tok, tokens, mask) == answers

    # A template without generation markers: each answer by the prefix rule, its newline too.
    (tmp_path / "plain.jinja").write_text(PLAIN_TEMPLATE)
    plain = tmp_path / "p.bin"
    prepare([str(tmp_path / "m.jsonl")], out=str(plain), tokenizer=spec,
            chat_template=str(tmp_path / "plain.jinja"))  # fmt: skip
    for record, tokens, mask in zip(records, *_prepared(plain), strict=True):
        answers = [m["content"] + "<|im_end|>\n" for m in _assistant(record)]
        assert _counted_text(tok, tokens, mask) == answers

    # --loss-on all: every token counts.
    prepare([str(tmp_path / "m.jsonl")], out=str(tmp_path / "a.bin"), tokenizer=spec,
            loss_on="all")  # fmt: skip
    assert all(m.all() for m in _prepared(tmp_path / "a.bin")[1])


def test_prepare_prompt_completion_counts_the_completion(chat_tok, tmp_path) -> None:
    tok = transformers.AutoTokenizer.from_pretrained(chat_tok)
    spec = f"hf:{chat_tok}"
    pairs = [("say one red fox", "the fox ran"), ("two logs", "by the old river")]
    strings = [{"prompt": p, "completion": c} for p, c in pairs]
    lists = [
        {"prompt": [{"role": "user", "content": p}],
         "completion": [{"role": "assistant", "content": c}]}
        for p, c in pairs
    ]  # fmt: skip
    prepare([str(_write(tmp_path / "s.jsonl", strings))], out=str(tmp_path / "s.bin"),
            tokenizer=spec)  # fmt: skip
    prepare([str(_write(tmp_path / "l.jsonl", lists))], out=str(tmp_path / "l.bin"),
            tokenizer=spec)  # fmt: skip
    assert (tmp_path / "s.bin").read_bytes() == (tmp_path / "l.bin").read_bytes()
    assert mask_path(tmp_path / "s.bin").read_bytes() == mask_path(tmp_path / "l.bin").read_bytes()
    for (_, completion), tokens, mask in zip(pairs, *_prepared(tmp_path / "s.bin"), strict=True):
        assert _counted_text(tok, tokens, mask) == [completion + "<|im_end|>\n"]


def test_prepare_refuses_a_folder_without_a_chat_template(chat_tok, tmp_path) -> None:
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "tokenizer.json").write_bytes((chat_tok / "tokenizer.json").read_bytes())
    data = _write(tmp_path / "m.jsonl", conversations(2))
    with pytest.raises(ConfigError) as refused:
        prepare([str(data)], out=str(tmp_path / "x.bin"), tokenizer=f"hf:{bare}")
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(f"--tokenizer 'hf:{bare}': the folder '{bare}' has no chat template")
    assert message.endswith("give one with --chat-template FILE")
    assert not (tmp_path / "x.bin").exists()
    (tmp_path / "t.jinja").write_text(TEMPLATE)
    prepare([str(data)], out=str(tmp_path / "x.bin"), tokenizer=f"hf:{bare}",
            chat_template=str(tmp_path / "t.jinja"))  # fmt: skip
    size = mask_path(tmp_path / "x.bin").stat().st_size
    assert size == read_sidecar(tmp_path / "x.bin").num_tokens


def test_a_truncated_mask_is_refused(chat_tok, tmp_path) -> None:
    out = tmp_path / "m.bin"
    prepare([str(_write(tmp_path / "m.jsonl", conversations(4)))], out=str(out),
            tokenizer=f"hf:{chat_tok}")  # fmt: skip
    cfg = DataConfig(path=str(out), tokenizer=f"hf:{chat_tok}", document_masking=True)
    with pytest.raises(DataError, match="holds conversations .* set data.document_masking"):
        build_datasets(DataConfig(path=str(out), tokenizer=f"hf:{chat_tok}"), 8)
    mask_path(out).write_bytes(b"\1\1\1")
    with pytest.raises(ConfigError, match="loss mask .* holds 3 entries, its sidecar says"):
        build_datasets(cfg, 8)


# --- fine-tuning, against TRL and across layouts ---


@pytest.fixture(scope="module")
def llama_dir(chat_tok, tmp_path_factory) -> Path:
    """A tiny random llama (every weight perturbed) over the chat tokenizer's vocabulary."""
    vocab = transformers.AutoTokenizer.from_pretrained(chat_tok).vocab_size + 3
    config = transformers.LlamaConfig(
        vocab_size=max(vocab, 320),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    folder = tmp_path_factory.mktemp("llama")
    model.save_pretrained(folder)
    return folder


TRL_CONVERSATIONS = 4


def _trl_first_step(chat_tok: Path, llama_dir: Path, records: list[dict], out: Path):
    """(loss, [counted tokens of each conversation]) of TRL SFTTrainer's first step on
    `records`, all in one padded batch, assistant-only loss, fp32."""
    import datasets
    from trl import SFTConfig, SFTTrainer

    seen = []

    class Recording(SFTTrainer):
        def compute_loss(self, model, inputs, *args, **kwargs):
            loss = super().compute_loss(model, inputs, *args, **kwargs)
            seen.append((float(loss.detach()), inputs["labels"].clone()))
            return loss

    args = SFTConfig(
        output_dir=str(out),
        per_device_train_batch_size=len(records),
        max_steps=1,
        learning_rate=1e-3,
        assistant_only_loss=True,
        bf16=False,
        fp16=False,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        seed=0,
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    trainer = Recording(
        model=model,
        args=args,
        train_dataset=datasets.Dataset.from_list(records),
        processing_class=transformers.AutoTokenizer.from_pretrained(chat_tok),
    )
    trainer.train()
    loss, labels = seen[0]
    return loss, sorted(tuple(row[row != -100].tolist()) for row in labels)


def test_first_step_loss_and_masking_equal_trl(chat_tok, llama_dir, tmp_path) -> None:
    records = conversations(TRL_CONVERSATIONS, seed=1)
    trl_loss, trl_counted = _trl_first_step(chat_tok, llama_dir, records, tmp_path / "trl")

    # The conversations twice: the first copy is the training split (one sequence holding all
    # of them, packed, with document masking), the second the validation split.
    out = tmp_path / "c.bin"
    prepare([str(_write(tmp_path / "c.jsonl", records + records))], out=str(out),
            tokenizer=f"hf:{chat_tok}")  # fmt: skip
    length = read_sidecar(out).num_tokens // 2
    fields = dict(
        data__path=str(out),
        data__tokenizer=f"hf:{chat_tok}",
        data__document_masking=True,
        data__val_fraction=0.5,
        training__seq_len=length - 1,
        training__global_batch_size=1,
        training__micro_batch_size=1,
        training__steps=1,
        model__family="llama",
        model__init_from=f"hf:{llama_dir}",
        checkpoint__interval_steps=0,
        checkpoint__at_end=False,
    )
    cfg = DataConfig(path=str(out), tokenizer=f"hf:{chat_tok}", document_masking=True,
                     val_fraction=0.5)  # fmt: skip
    train, _ = build_datasets(cfg, length - 1)
    loader = DistributedBatchLoader(
        train, global_batch_size=1, micro_batch_size=1, dp_rank=0, dp_size=1, seed=0
    )
    [(_, targets, documents)] = loader.next_batch()
    counted = sorted(
        tuple(targets[0][(documents[0] == d) & (targets[0] >= 0)].tolist())
        for d in documents[0].unique()
    )
    assert counted == trl_counted

    loss = losses(train_in_process(tmp_path / "run", **fields))[1]
    print(f"first-step loss: distrain {loss!r}, TRL {trl_loss!r}, diff {abs(loss - trl_loss):.2e}")
    assert abs(loss - trl_loss) <= 1e-5 * abs(trl_loss)


FINE_TUNE = {
    "training__steps": 3,
    "training__global_batch_size": 8,
    "training__micro_batch_size": 2,
    "training__seq_len": 32,
    "training__deterministic": True,
    "data__document_masking": True,
    "model__family": "llama",
    "checkpoint__interval_steps": 0,
    "checkpoint__at_end": False,
}
LAYOUTS = {
    "dp2": {},
    "tp2": {"parallel__tp": 2},
    "pp2": {"parallel__pp": 2},
}


@pytest.fixture(scope="module")
def fine_tune(chat_tok, llama_dir, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("ft") / "chat.bin"
    data = _write(out.with_name("chat.jsonl"), conversations(80, seed=2))
    prepare([str(data)], out=str(out), tokenizer=f"hf:{chat_tok}")
    return dict(
        FINE_TUNE,
        data__path=str(out),
        data__tokenizer=f"hf:{chat_tok}",
        model__init_from=f"hf:{llama_dir}",
    )


@pytest.fixture(scope="module")
def reference(fine_tune, tmp_path_factory) -> dict[int, float]:
    return losses(train_in_process(tmp_path_factory.mktemp("ref") / "run", **fine_tune))


@pytest.fixture(scope="module")
def batched(fine_tune, request, tmp_path_factory):
    runs = {
        f"test_fine_tune_matches_across_layouts[{name}]": Run(2, dict(fine_tune, **fields))
        for name, fields in LAYOUTS.items()
    }
    return Batches(selected(runs, request.session.items), tmp_path_factory.mktemp("batched"))


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fine_tune_matches_across_layouts(layout, reference, batched, request) -> None:
    outcome = batched.result(request.node.name)
    assert outcome.error is None, outcome.error
    got = losses(read_metrics(outcome.run_dir / "metrics.jsonl"))
    print(f"{layout}: {got} vs 1 process {reference}")
    assert_parity(got, reference)
