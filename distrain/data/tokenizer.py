"""Byte-level tokenizer: UTF-8 bytes are the tokens, so any text needs no vocabulary file."""

from __future__ import annotations


class ByteTokenizer:
    """Tokens are UTF-8 bytes (vocab 256); decoding replaces invalid sequences rather than failing,
    because sampled token streams may cut a multi-byte character in half."""

    vocab_size: int = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, tokens: list[int]) -> str:
        return bytes(tokens).decode("utf-8", errors="replace")
