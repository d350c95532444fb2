"""Tokenizers and `distrain prepare`: a BPE built with the `tokenizers` library on stdlib source,
text folders, JSONL and saved `datasets` inputs tokenized into a token file whose counts and
document boundaries match the tokenizer's own encoding, the sidecar's dtype choice, no write
through a symlink planted at an output's name, training on the prepared file in this process
and generating with the run's tokenizer. All local: no hub."""

from __future__ import annotations

import base64
import json
import math
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

from distrain.config.schema import DataConfig
from distrain.data import DataError, DistributedBatchLoader, build_datasets, read_corpus
from distrain.data import prepare as prepare_module
from distrain.data.prepare import prepare
from distrain.data.tokenizer import load_tokenizer
from distrain.data.tokfile import docs_path, read_sidecar, token_dtype
from distrain.errors import ConfigError

STDLIB = Path(sysconfig.get_paths()["stdlib"])
BPE_VOCAB = 512
PADDED_VOCAB = 1024  # the model's vocabulary may be larger than the tokenizer's (GPT-2: 50304)
# Sampled ids per generation: enough that a padding id slips through when unmasked (see below).
NEW_TOKENS = 16
EOS = "<|endoftext|>"


@pytest.fixture(scope="module")
def bpe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A byte-level BPE of 512 tokens trained on the stdlib's json package; its folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([str(p) for p in sorted((STDLIB / "json").glob("*.py"))], trainer)
    folder = tmp_path_factory.mktemp("bpe")
    tok.save(str(folder / "tokenizer.json"))
    return folder


def _documents(folder: Path) -> list[str]:
    return [p.read_text() for p in sorted(folder.glob("*.py"))]


def _expected(spec: str, texts: list[str], eos_id: int | None) -> list[list[int]]:
    tok = load_tokenizer(spec)
    return [tok.encode(t) + ([] if eos_id is None else [eos_id]) for t in texts]


def _document_boundaries(data: Path) -> np.ndarray:
    """The int64 offsets [0, end of doc 0, ..., num_tokens] of a prepared token file."""
    return np.load(docs_path(data), mmap_mode="r")


def _prepared_docs(out: Path) -> list[list[int]]:
    tokens = read_corpus(DataConfig(path=str(out), tokenizer=read_sidecar(out).tokenizer))
    bounds = _document_boundaries(out)
    return [tokens[a:b].tolist() for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def test_prepare_folder_counts_and_boundaries_match_the_tokenizer(bpe, tmp_path) -> None:
    spec = f"hf:{bpe}"
    one = prepare([str(STDLIB / "json")], out=str(tmp_path / "one.bin"), tokenizer=spec,
                  glob="*.py", eos=EOS, workers=1)  # fmt: skip
    two = prepare([str(STDLIB / "json")], out=str(tmp_path / "two.bin"), tokenizer=spec,
                  glob="*.py", eos=EOS, workers=2)  # fmt: skip
    # The same bytes whatever the number of processes.
    assert (tmp_path / "one.bin").read_bytes() == (tmp_path / "two.bin").read_bytes()
    eos_id = load_tokenizer(spec).token_id(EOS)
    expected = _expected(spec, _documents(STDLIB / "json"), eos_id)
    assert _prepared_docs(tmp_path / "two.bin") == expected
    sidecar = two.sidecar
    assert sidecar == one.sidecar
    assert sidecar.tokenizer == f"hf:{bpe / 'tokenizer.json'}"
    assert (sidecar.vocab_size, sidecar.dtype, sidecar.eos_id) == (BPE_VOCAB, "uint16", eos_id)
    assert sidecar.num_tokens == sum(map(len, expected))
    assert sidecar.num_documents == len(expected)
    assert (tmp_path / "two.bin").stat().st_size == 2 * sidecar.num_tokens


def test_prepare_jsonl_and_saved_datasets(bpe, tmp_path, monkeypatch) -> None:
    import datasets

    spec = f"hf:{bpe / 'tokenizer.json'}"
    texts = [f"record {i}: ünïcode ✓ {'x' * (i % 7)}\nline two" for i in range(300)]
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"id": i, "body": t}) + "\n" for i, t in enumerate(texts)))
    # Small units, so that the file is cut in many places and every cut must fall between lines.
    monkeypatch.setattr(prepare_module, "UNIT_BYTES", 1000)
    prepare([str(jsonl)], out=str(tmp_path / "j.bin"), tokenizer=spec, field="body", workers=2)
    assert _prepared_docs(tmp_path / "j.bin") == _expected(spec, texts, None)

    table = datasets.Dataset.from_dict({"body": texts, "n": list(range(300))})
    table.save_to_disk(str(tmp_path / "ds"))
    monkeypatch.setattr(prepare_module, "UNIT_ROWS", 64)
    prepare([str(tmp_path / "ds")], out=str(tmp_path / "d.bin"), tokenizer=spec, field="body",
            workers=2)  # fmt: skip
    assert (tmp_path / "d.bin").read_bytes() == (tmp_path / "j.bin").read_bytes()

    splits = datasets.DatasetDict({"train": table.select(range(10)), "test": table.select([11])})
    splits.save_to_disk(str(tmp_path / "dd"))
    result = prepare([str(tmp_path / "dd")], out=str(tmp_path / "t.bin"), tokenizer=spec,
                     field="body", split="test")  # fmt: skip
    assert _prepared_docs(tmp_path / "t.bin") == _expected(spec, [texts[11]], None)
    assert result.sidecar.num_documents == 1
    with pytest.raises(ConfigError, match="--split 'val'.* has splits train, test; choose one"):
        prepare([str(tmp_path / "dd")], out=str(tmp_path / "x.bin"), tokenizer=spec,
                field="body", split="val")  # fmt: skip
    with pytest.raises(ConfigError, match=r"--field 'text': the dataset .* \(columns: body, n\)"):
        prepare([str(tmp_path / "ds")], out=str(tmp_path / "x.bin"), tokenizer=spec)
    with pytest.raises(ConfigError, match="--field 'text': .*the line at byte 0 has no such key"):
        prepare([str(jsonl)], out=str(tmp_path / "x.bin"), tokenizer=spec)
    assert not (tmp_path / "x.bin").exists() and not (tmp_path / "x.bin.tmp").exists()


def _tiktoken_file(path: Path) -> Path:
    """A tiktoken BPE file: every byte, then a few merges (tiktoken's base64 + rank lines)."""
    ranks = [bytes([b]) for b in range(256)] + [b"de", b"def", b" s"]
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for r, t in enumerate(ranks)))
    return path


def test_sidecar_dtype_follows_the_vocabulary_size(tmp_path) -> None:
    assert token_dtype(256) == np.uint16 and token_dtype(65536) == np.uint16
    assert token_dtype(65537) == np.uint32
    # cl100k_base's special tokens sit above id 100256: this small file has a 100277-id vocabulary.
    spec = f"tiktoken:{_tiktoken_file(tmp_path / 'cl100k_base.tiktoken')}"
    tok = load_tokenizer(spec)
    assert tok.vocab_size == 100277 and tok.token_id(EOS) == 100257
    assert tok.encode("def self") == [257, 258, *b"elf"]
    text = tmp_path / "a.py"
    text.write_text("def f(self):\n    return self\n")
    out = tmp_path / "big.bin"
    result = prepare([str(text)], out=str(out), tokenizer=spec, eos=EOS)
    assert result.sidecar.dtype == "uint32" and out.stat().st_size == 4 * result.sidecar.num_tokens
    tokens = read_corpus(DataConfig(path=str(out), tokenizer=spec), vocab_size=tok.vocab_size)
    assert tokens.tolist() == tok.encode(text.read_text()) + [100257]


def test_tokenizer_errors_are_one_line(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "empty-cache"))
    cases = {
        "tiktoken:cl100k_base": "its BPE file is not in tiktoken's local cache and distrain does "
        "not download; copy cl100k_base.tiktoken to this machine and set data.tokenizer = "
        "'tiktoken:/path/to/cl100k_base.tiktoken'",
        "tiktoken:nope": "no such file, and not a tiktoken encoding name (one of gpt2",
        f"tiktoken:{_tiktoken_file(tmp_path / 'mine.tiktoken')}": "must be named after its "
        "encoding, one of gpt2.tiktoken",
        f"hf:{tmp_path}": "holds no tokenizer.json",
        "sentencepiece:x": "expected one of bytes, hf:DIR_OR_FILE, tiktoken:NAME_OR_FILE",
    }
    for spec, expected in cases.items():
        with pytest.raises(ConfigError) as info:
            load_tokenizer(spec)
        assert expected in str(info.value) and "\n" not in str(info.value), spec


def test_prepare_refuses_bad_options(bpe, tmp_path) -> None:
    spec = f"hf:{bpe}"
    with pytest.raises(ConfigError, match="--out 'x.npy' must end in .bin"):
        prepare([str(STDLIB / "json")], out="x.npy", tokenizer=spec)
    with pytest.raises(ConfigError, match="--eos '<eos>' is not a token of --tokenizer"):
        prepare([str(STDLIB / "json")], out=str(tmp_path / "x.bin"), tokenizer=spec, eos="<eos>")
    with pytest.raises(ConfigError, match="no such input file or folder"):
        prepare([str(tmp_path / "missing")], out=str(tmp_path / "x.bin"), tokenizer=spec)


def test_prepare_writes_through_no_planted_link(tmp_path) -> None:
    """Symlinks planted at the token file, its boundaries and its sidecar are replaced, their
    target untouched; one at the temporary name is refused in one line."""
    from distrain.files import SymlinkRefused

    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    text = tmp_path / "text"
    text.mkdir()
    (text / "a.txt").write_text("alpha beta gamma " * 50)
    out = tmp_path / "data.bin"
    written = (out, docs_path(out), out.with_name("data.bin.json"))
    for path in written:
        path.symlink_to(victim)
    result = prepare([str(text)], out=str(out), tokenizer="bytes")
    assert victim.read_text() == "precious\n"
    assert not any(p.is_symlink() for p in written)
    assert np.load(docs_path(out)).tolist() == [0, result.sidecar.num_tokens]
    tmp = out.with_name("data.bin.tmp")
    tmp.symlink_to(victim)
    with pytest.raises(SymlinkRefused, match="data.bin.tmp is a symlink") as info:
        prepare([str(text)], out=str(out), tokenizer="bytes")
    assert "\n" not in str(info.value) and victim.read_text() == "precious\n"


def test_data_prepared_with_another_tokenizer_is_refused(bpe, tmp_path) -> None:
    from distrain.config.io import load_config
    from distrain.launch.preflight import preflight

    out = tmp_path / "d.bin"
    prepare([str(STDLIB / "json" / "tool.py")], out=str(out), tokenizer=f"hf:{bpe}")
    expected = f"was prepared with tokenizer 'hf:{bpe / 'tokenizer.json'}' (vocab 512) but "
    with pytest.raises(ConfigError, match="data.tokenizer is 'bytes'") as info:
        read_corpus(DataConfig(path=str(out)))
    assert expected in str(info.value)
    cfg = load_config(None, [("data.path", str(out)), ("run.dir", str(tmp_path / "run"))])
    with pytest.raises(ConfigError, match="set data.tokenizer = 'hf:"):
        preflight(cfg)  # before any worker starts
    with open(out, "r+b") as f:
        f.truncate(out.stat().st_size - 2)
    with pytest.raises(DataError, match="sidecar says 1580; the file is incomplete"):
        read_corpus(DataConfig(path=str(out), tokenizer=f"hf:{bpe}"))


def test_prepare_train_generate(bpe, tmp_path) -> None:
    """A BPE-tokenized corpus trains in this process, the run decodes with its tokenizer and
    exports it with the weights; the loader on the token file stays layout-independent and
    resumable."""
    from helpers import losses, train_in_process

    from distrain.inference.generate import generate_text, load_model, sample

    spec = f"hf:{bpe}"
    out = tmp_path / "stdlib-json.bin"
    prepare([str(STDLIB / "json"), str(STDLIB / "email")], out=str(out), tokenizer=spec,
            glob="*.py", eos=EOS, workers=2)  # fmt: skip
    fields = {"data__path": str(out), "data__tokenizer": spec}
    data = DataConfig(path=str(out), tokenizer=spec)
    train, _ = build_datasets(data, 32, vocab_size=BPE_VOCAB)
    whole = DistributedBatchLoader(train, global_batch_size=8, micro_batch_size=4, dp_rank=0,
                                   dp_size=1, seed=3)  # fmt: skip
    halves = [DistributedBatchLoader(train, global_batch_size=8, micro_batch_size=4, dp_rank=r,
                                     dp_size=2, seed=3) for r in (0, 1)]  # fmt: skip
    step = whole.next_batch()
    assert torch.equal(
        torch.cat([x for x, _ in step]), torch.cat([h.next_batch()[0][0] for h in halves])
    )
    resumed = DistributedBatchLoader(train, global_batch_size=8, micro_batch_size=8, dp_rank=0,
                                     dp_size=1, seed=3)  # fmt: skip
    resumed.load_state_dict(whole.state_dict())
    assert torch.equal(torch.cat([x for x, _ in whole.next_batch()]), resumed.next_batch()[0][0])

    rows = train_in_process(
        tmp_path / "run",
        **fields,
        model__family="llama",
        model__preset="llama-tiny",
        model__vocab_size=PADDED_VOCAB,
        training__seq_len=32,
        training__steps=4,
        training__global_batch_size=8,
        training__micro_batch_size=8,
        optim__warmup_steps=0,
    )
    loss = losses(rows)
    assert sorted(loss) == [1, 2, 3, 4]
    # A fresh model predicts about uniformly over its 1024 ids; training lowers the loss.
    assert abs(loss[1] - math.log(PADDED_VOCAB)) < 0.5 and loss[4] < loss[1]

    tok = load_tokenizer(spec)
    prompt = "def loads(s"
    text = generate_text(tmp_path / "run", prompt, max_new_tokens=NEW_TOKENS, temperature=1.0,
                         top_k=None, seed=5)  # fmt: skip
    model, _ = load_model(tmp_path / "run", torch.device("cpu"))
    context = model.args.max_seq_len
    ids = sample(model, tok.encode(prompt), max_seq_len=context, max_new_tokens=NEW_TOKENS,
                 temperature=1.0, top_k=None, generator=torch.Generator().manual_seed(5),
                 num_tokens=tok.vocab_size)  # fmt: skip
    assert text == prompt + tok.decode(ids)
    # Only ids the tokenizer has. Half of the 1024 ids are padding, which 4 steps leave near
    # uniform: the same draws without num_tokens do pick one (16 would all miss with
    # probability ~0.5^16), so the bound below has teeth.
    assert len(ids) == NEW_TOKENS and max(ids) < BPE_VOCAB
    unmasked = sample(model, tok.encode(prompt), max_seq_len=context, max_new_tokens=NEW_TOKENS,
                      temperature=1.0, top_k=None,
                      generator=torch.Generator().manual_seed(5))  # fmt: skip
    assert max(unmasked) >= BPE_VOCAB

    from transformers import AutoTokenizer

    from distrain.interop.export import export_hf

    export_hf(tmp_path / "run", tmp_path / "hf")
    exported = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    sample_text = (STDLIB / "json" / "scanner.py").read_text() + EOS + "ünïcode ✓"
    assert exported.encode(sample_text) == tok.encode(sample_text)
    assert exported.decode(tok.encode(sample_text)) == sample_text
