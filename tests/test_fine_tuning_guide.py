"""docs/guides/fine-tuning.md, run as written: its five commands, in order, in a folder holding
what the guide starts from (tests/test_doc_snippets.py's RUN_IN_ORDER names this test for the
page). All local: a tiny random Qwen3 made with transformers, saved with a byte-level BPE and a
ChatML chat template as `models/my-qwen3`, and 600 conversations as `data/chat.jsonl`."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

import pytest
import torch
from test_chat import chat_tok, conversations  # noqa: F401  (chat_tok: the tokenizer fixture)
from test_doc_snippets import ROOT, RUN_IN_ORDER, SNIPPETS
from test_hf_interop import LOGIT_TOL, _hf_configs

from distrain.observe.metrics import read_metrics

transformers = pytest.importorskip("transformers")

PAGE = ROOT / "docs" / "guides" / "fine-tuning.md"
MODEL = "models/my-qwen3"


def _argv(words: list[str]) -> list[str]:
    """A command of the page as this interpreter runs it (`distrain` is its console script)."""
    if words[0] == "distrain":
        return [sys.executable, "-m", "distrain", *words[1:]]
    assert words[0] in ("python", "python3"), words
    return [sys.executable, *words[1:]]


def test_the_guide_runs_as_written(chat_tok, tmp_path):  # noqa: F811
    assert RUN_IN_ORDER[str(PAGE.relative_to(ROOT))].endswith(
        "test_fine_tuning_guide.py::test_the_guide_runs_as_written"
    )
    commands = [s.text for s in SNIPPETS if s.page == PAGE]
    assert len(commands) == 5, commands  # the page promises five
    # What the guide starts from: a model folder with its tokenizer and chat template...
    folder = tmp_path / MODEL
    transformers.AutoTokenizer.from_pretrained(chat_tok).save_pretrained(folder)
    config = _hf_configs()["qwen3"]
    config.vocab_size = 320
    config.max_position_embeddings = 1024  # the guide's training.seq_len
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    assert (folder / "chat_template.jinja").is_file()
    # ... and a chat JSONL file.
    (tmp_path / "data").mkdir()
    records = conversations(600)
    (tmp_path / "data" / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))

    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    said = []
    for command in commands:
        done = subprocess.run(
            _argv(shlex.split(command)), cwd=tmp_path, env=env, capture_output=True, text=True,
            timeout=300,
        )  # fmt: skip
        assert done.returncode == 0, f"{command}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        said.append(done.stdout)

    # 1: tokens and the assistant-only loss mask.
    assert (tmp_path / "data" / "chat.bin.mask").is_file()
    # 2: a LoRA fine-tune of the folder's weights, its loss and held-out loss logged.
    rows = read_metrics(tmp_path / "runs" / "chat" / "metrics.jsonl")
    assert max(r["step"] for r in rows if "loss" in r) == 30
    assert any("val_loss" in r for r in rows)
    # 3 and 4: the merged export, with the chat template, answers as the assistant.
    assert (tmp_path / "exported" / "chat" / "chat_template.jinja").is_file()
    assert said[3].startswith("{'role': 'assistant', 'content': "), said[3]
    # 5: the PEFT adapter of the run's LoRA settings.
    adapter = json.loads(
        (tmp_path / "exported" / "chat-adapter" / "adapter_config.json").read_text()
    )
    assert adapter["r"] == 16 and adapter["lora_alpha"] == 32
    assert sorted(adapter["target_modules"]) == ["k_proj", "o_proj", "q_proj", "v_proj"]
    # peft's base model + adapter (the page's `peft.PeftModel.from_pretrained` line) and the
    # merged export give the same logits, which the adapter moved away from the base's.
    peft = pytest.importorskip("peft")
    load = transformers.AutoModelForCausalLM.from_pretrained
    tokens = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        tuned = peft.PeftModel.from_pretrained(
            load(folder, dtype=torch.float32), tmp_path / "exported" / "chat-adapter"
        ).eval()
        got = tuned(tokens).logits
        with tuned.disable_adapter():
            base = tuned(tokens).logits
        merged = load(tmp_path / "exported" / "chat", dtype=torch.float32).eval()(tokens).logits
    torch.testing.assert_close(got, merged, rtol=0, atol=LOGIT_TOL)
    assert (got - base).abs().max() > 1e-4
