"""Tokenizers named by `data.tokenizer`: "bytes" (UTF-8 bytes, vocab 256, no file), "hf:PATH" (a
Hugging Face `tokenizers` tokenizer.json, or a folder holding one) and "tiktoken:NAME_OR_FILE".

Everything is read from local files: runs and tests never download. tiktoken's named encodings
are built from a BPE file tiktoken downloads on first use; a NAME is accepted only when that file is
already in tiktoken's cache, and a FILE named after its encoding (`cl100k_base.tiktoken`) is read
directly. Each tokenizer has a `fingerprint` (a hash of its file) so that a token file prepared
with one tokenizer is never trained or decoded with another.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path
from typing import Protocol
from unittest import mock

from distrain.errors import ConfigError, MissingInput

HF_FILE = "tokenizer.json"
_KINDS = ("bytes", "hf:DIR_OR_FILE", "tiktoken:NAME_OR_FILE")


class Tokenizer(Protocol):
    spec: str
    """How to name it again: "bytes", "hf:/abs/path/tokenizer.json", "tiktoken:NAME" or FILE."""
    vocab_size: int
    fingerprint: str

    def encode(self, text: str) -> list[int]: ...

    def decode(self, tokens: list[int]) -> str: ...

    def token_id(self, token: str) -> int | None: ...


class ByteTokenizer:
    """Tokens are UTF-8 bytes (vocab 256); decoding replaces invalid sequences rather than failing,
    because sampled token streams may cut a multi-byte character in half."""

    spec: str = "bytes"
    vocab_size: int = 256
    fingerprint: str = "bytes"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, tokens: list[int]) -> str:
        return bytes(tokens).decode("utf-8", errors="replace")

    def token_id(self, token: str) -> int | None:
        return None


class HFTokenizer:
    """A `tokenizers` tokenizer from its tokenizer.json (what `save_pretrained` writes for any fast
    tokenizer). vocab_size counts added tokens too: their ids follow the base vocabulary."""

    def __init__(self, file: Path, field: str) -> None:
        try:
            from tokenizers import Tokenizer as RustTokenizer
        except ImportError:
            raise ConfigError(
                f"{field} 'hf:...' needs the tokenizers package; pip install tokenizers"
            ) from None
        try:
            self._tok = RustTokenizer.from_file(str(file))
        except Exception as e:  # the Rust side raises a bare Exception for malformed files
            first_line = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ConfigError(
                f"{field}: {str(file)!r} is not a tokenizer.json ({first_line})"
            ) from None
        self.file = file
        self.spec = f"hf:{file}"
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.fingerprint = _sha256(file)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, tokens: list[int]) -> str:
        return self._tok.decode(tokens, skip_special_tokens=False)

    def token_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)


class TiktokenTokenizer:
    """A tiktoken encoding. Documents are encoded as ordinary text: a special token's spelling in
    a corpus stays text rather than becoming the special token."""

    def __init__(self, encoding: object, spec: str, fingerprint: str) -> None:
        self._enc = encoding
        self.spec = spec
        self.vocab_size = int(encoding.n_vocab)  # type: ignore[attr-defined]
        self.fingerprint = fingerprint

    def encode(self, text: str) -> list[int]:
        return self._enc.encode_ordinary(text)  # type: ignore[attr-defined]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, tokens: list[int]) -> str:
        return self._enc.decode(tokens, errors="replace")  # type: ignore[attr-defined]

    def token_id(self, token: str) -> int | None:
        try:
            return self._enc.encode_single_token(token)  # type: ignore[attr-defined]
        except KeyError:
            return None


@functools.lru_cache(maxsize=8)
def load_tokenizer(spec: str, field: str = "data.tokenizer") -> Tokenizer:
    """The tokenizer `spec` names; a one-line ConfigError naming `field` when it cannot be had."""
    kind, _, arg = spec.partition(":")
    if spec == "bytes":
        return ByteTokenizer()
    if kind == "hf" and arg:
        return HFTokenizer(_hf_file(Path(arg).expanduser(), field), field)
    if kind == "tiktoken" and arg:
        return _tiktoken(arg, field)
    raise ConfigError(f"{field} = {spec!r}: expected one of {', '.join(_KINDS)}")


def hf_tokenizer_dir(spec: str) -> Path | None:
    """The folder holding an hf: tokenizer's files (tokenizer.json and its companions such as
    tokenizer_config.json), None for other tokenizers."""
    kind, _, arg = spec.partition(":")
    if kind != "hf":
        return None
    path = Path(arg).expanduser().resolve()
    return path if path.is_dir() else path.parent


def _hf_file(path: Path, field: str) -> Path:
    file = path / HF_FILE if path.is_dir() else path
    if not file.is_file():
        where = f"{str(path)!r} holds no {HF_FILE}" if path.is_dir() else f"no file {str(path)!r}"
        raise MissingInput(
            f"{field}: {where}; point it at a tokenizer.json or a folder with one (a fast "
            "tokenizer's save_pretrained writes it)"
        )
    return file.resolve()


def _tiktoken(arg: str, field: str) -> TiktokenTokenizer:
    try:
        import tiktoken
        import tiktoken.load
        import tiktoken.registry
    except ImportError:
        raise ConfigError(
            f"{field} 'tiktoken:...' needs the tiktoken package; pip install tiktoken"
        ) from None
    path = Path(arg).expanduser()
    names = tiktoken.registry.list_encoding_names()
    read_cached = tiktoken.load.read_file_cached
    files: list[bytes] = []
    if path.is_file():
        name, spec = path.name.removesuffix(".tiktoken"), f"tiktoken:{path.resolve()}"
        if name not in names:
            raise ConfigError(
                f"{field}: the tiktoken file {str(path)!r} must be named after its encoding, one "
                f"of {', '.join(n + '.tiktoken' for n in names)} (its split pattern and special "
                "tokens come from the name)"
            )

        def read(blobpath: str, expected_hash: str | None = None) -> bytes:
            files.append(path.read_bytes())
            return files[-1]

    elif arg in names:
        name, spec = arg, f"tiktoken:{arg}"

        def offline(blobpath: str) -> bytes:
            raise MissingInput(
                f"{field} = 'tiktoken:{arg}': its BPE file is not in tiktoken's local cache and "
                f"distrain does not download; copy {blobpath.rsplit('/', 1)[-1]} to this machine "
                f"and set {field} = 'tiktoken:/path/to/{arg}.tiktoken'"
            )

        def read(blobpath: str, expected_hash: str | None = None) -> bytes:
            # read_file is what read_file_cached calls on a cache miss: refusing there keeps
            # tiktoken offline while still using (and hash-checking) its cache.
            with mock.patch.object(tiktoken.load, "read_file", offline):
                files.append(read_cached(blobpath, expected_hash))
            return files[-1]

    else:
        raise ConfigError(
            f"{field} = 'tiktoken:{arg}': no such file, and not a tiktoken encoding name (one of "
            f"{', '.join(names)})"
        )
    # An encoding's constructor holds its split pattern and special tokens and reads its BPE file
    # through tiktoken.load.read_file_cached; `read` supplies that file from local storage.
    constructor = tiktoken.registry.ENCODING_CONSTRUCTORS[name]  # filled by list_encoding_names
    with mock.patch.object(tiktoken.load, "read_file_cached", read):
        try:
            params = constructor()
            if path.is_file():  # a file may hold another vocabulary than the published one
                params.pop("explicit_n_vocab", None)
            encoding = tiktoken.Encoding(**params)
        except ConfigError:
            raise
        except Exception as e:  # a malformed file: base64 or rank parse errors
            raise ConfigError(f"{field}: cannot read {arg!r} as tiktoken {name} ({e})") from None
    return TiktokenTokenizer(encoding, spec, _sha256_bytes(b"".join(files)))


def _sha256(path: Path) -> str:
    return _sha256_bytes(path.read_bytes())


def _sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
