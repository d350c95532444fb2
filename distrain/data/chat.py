"""Conversations for `distrain prepare`: JSONL records in the formats people have, rendered with
the tokenizer folder's own chat template by transformers' `apply_chat_template`, each with the
mask of the tokens that count for the loss, computed as TRL's SFTTrainer computes it:

- `messages` (a list of {role, content}): by default the assistant's answers only, the tokens
  the template renders inside `{% generation %}` ... `{% endgeneration %}` (transformers'
  assistant mask, TRL's assistant_only_loss). A template without those markers: the tokens each
  assistant message adds after the rendering of the conversation before it with the generation
  prompt (the answer and its end-of-turn tokens).
- `prompt` and `completion` (strings: one user turn and one assistant turn; or TRL's
  conversational lists of messages): the tokens after the prompt rendered with the generation
  prompt, where it and the whole conversation first differ (TRL's completion_only_loss).

With loss_on = "all" every token counts. The template is the folder's (tokenizer_config.json's
`chat_template` or chat_template.jinja), or a file given with --chat-template.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from distrain.data.tokenizer import hf_tokenizer_dir
from distrain.errors import ConfigError

LossOn = Literal["assistant", "all"]
LOSS_ON: tuple[LossOn, ...] = ("assistant", "all")
_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")


def is_conversation(record: object) -> bool:
    """A JSONL record in one of the conversation formats."""
    return isinstance(record, dict) and (
        "messages" in record or ("prompt" in record and "completion" in record)
    )


class ChatRenderer:
    """Renders conversations of the tokenizer `spec` (hf:DIR) with its chat template (or the
    template file `template`) into (token ids, loss mask)."""

    def __init__(self, spec: str, template: str | None, loss_on: LossOn) -> None:
        folder = hf_tokenizer_dir(spec)
        if folder is None:
            raise ConfigError(
                f"--tokenizer {spec!r}: conversations are rendered with a Hugging Face "
                "tokenizer's chat template; use --tokenizer hf:DIR (the model's folder)"
            )
        if loss_on not in LOSS_ON:
            raise ConfigError(f"--loss-on {loss_on!r}: expected one of {', '.join(LOSS_ON)}")
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise ConfigError(
                "prepare: conversations need the transformers package to render the chat "
                "template; pip install 'distrain[hf]'"
            ) from None
        self.tokenizer = AutoTokenizer.from_pretrained(str(folder))
        if template is not None:
            path = Path(template).expanduser()
            if not path.is_file():
                raise ConfigError(f"--chat-template: no such file {template!r}")
            self.template: str = path.read_text()
        else:
            found = self.tokenizer.chat_template
            if isinstance(found, dict):  # named variants: the default one
                found = found.get("default")
            if not found:
                raise ConfigError(
                    f"--tokenizer {spec!r}: the folder {str(folder)!r} has no chat template "
                    "(tokenizer_config.json chat_template or chat_template.jinja); give one "
                    "with --chat-template FILE"
                )
            self.template = found
        self.loss_on = loss_on
        self.markers = _GENERATION.search(self.template) is not None

    def _ids(self, messages: list, **kwargs: Any) -> dict:
        return self.tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=True, chat_template=self.template, **kwargs
        )

    def render(self, record: dict, where: str) -> tuple[list[int], list[int]]:
        """(token ids, loss mask) of one conversation record; `where` names it in errors."""
        tools = record.get("tools")
        extra = {"tools": tools} if tools else {}
        if "messages" in record:
            messages = _messages(record["messages"], where, "messages")
            if self.loss_on == "all":
                ids = list(self._ids(messages, **extra)["input_ids"])
                return ids, [1] * len(ids)
            if self.markers:
                out = self._ids(messages, return_assistant_tokens_mask=True, **extra)
                ids, mask = list(out["input_ids"]), list(out["assistant_masks"])
            else:
                ids, mask = self._assistant_by_prefix(messages, where, extra)
            if not any(mask):
                raise ConfigError(
                    f"prepare: {where}: no token of the conversation is an assistant's answer "
                    "(no assistant message, or a chat template whose {% generation %} markers "
                    "hold nothing); use --loss-on all to train on every token"
                )
            return ids, mask
        prompt = _turns(record["prompt"], "user", where, "prompt")
        completion = _turns(record["completion"], "assistant", where, "completion")
        ids = list(self._ids(prompt + completion, **extra)["input_ids"])
        if self.loss_on == "all":
            return ids, [1] * len(ids)
        prompt_ids = list(self._ids(prompt, add_generation_prompt=True, **extra)["input_ids"])
        start = _common_prefix(prompt_ids, ids)
        return ids, [0] * start + [1] * (len(ids) - start)

    def _assistant_by_prefix(
        self, messages: list, where: str, extra: dict
    ) -> tuple[list[int], list[int]]:
        """The assistant mask of a template without generation markers: each assistant turn
        is the tokens its message adds after the conversation before it with the generation
        prompt (a template must render a conversation's start the same way alone)."""
        ids = list(self._ids(messages, **extra)["input_ids"])
        mask = [0] * len(ids)
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = self._ids(messages[:i], add_generation_prompt=True, **extra)["input_ids"]
            upto = self._ids(messages[: i + 1], **extra)["input_ids"]
            start, stop = _common_prefix(before, ids), len(upto)
            if list(upto) != ids[:stop]:
                raise ConfigError(
                    f"prepare: {where}: the chat template renders the start of the "
                    "conversation differently alone, so the assistant's tokens cannot be told "
                    "apart; give a template with {% generation %} markers (--chat-template) or "
                    "use --loss-on all"
                )
            mask[start:stop] = [1] * (stop - start)
        return ids, mask


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _messages(value: object, where: str, key: str) -> list[dict]:
    if not isinstance(value, list) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m for m in value
    ):
        raise ConfigError(
            f'prepare: {where}: {key!r} is not a list of messages ({{"role": ..., '
            '"content": ...}})'
        )
    return value


def _turns(value: object, role: str, where: str, key: str) -> list[dict]:
    """A prompt or completion: a string is one message of `role`; a list is messages."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    return _messages(value, where, key)
