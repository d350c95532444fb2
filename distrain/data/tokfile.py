"""Prepared token files: DATA.bin (raw token ids, uint16 or uint32 by vocabulary size) beside
DATA.bin.json, its sidecar (tokenizer, vocabulary size, token count, element type) and
DATA.bin.docs.npy (int64 document boundaries: document i is tokens [docs[i], docs[i + 1])).
Conversations (chat.py) also have DATA.bin.mask, named by the sidecar's `loss_mask`: one uint8 a
token, 1 where the token counts for the loss (is a target), 0 where it does not.

The sidecar is written last, so a token file with a sidecar is complete. Training reads the
element type from it and refuses data prepared with another tokenizer than data.tokenizer.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from distrain.data.tokenizer import Tokenizer
from distrain.errors import ConfigError
from distrain.files import write_atomic

FORMAT = "distrain-tokens"
VERSION = 1


@dataclass(frozen=True)
class Sidecar:
    tokenizer: str
    tokenizer_sha256: str
    vocab_size: int
    dtype: str
    num_tokens: int
    num_documents: int
    eos_id: int | None = None
    loss_mask: str | None = None
    """The file name (beside the token file) of the loss mask, None when every token counts."""
    format: str = FORMAT
    version: int = VERSION


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned type holding every id below vocab_size: uint16 up to 65536 ids."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def sidecar_path(data: Path) -> Path:
    return data.with_name(data.name + ".json")


def docs_path(data: Path) -> Path:
    return data.with_name(data.name + ".docs.npy")


def mask_path(data: Path) -> Path:
    return data.with_name(data.name + ".mask")


def write_sidecar(data: Path, sidecar: Sidecar) -> None:
    write_atomic(sidecar_path(data), json.dumps(asdict(sidecar), indent=2) + "\n")


def read_sidecar(data: Path) -> Sidecar | None:
    """The sidecar beside token file `data`, None when there is none (a raw token file)."""
    path = sidecar_path(data)
    if not path.is_file():
        return None
    try:
        fields = json.loads(path.read_text())
        sidecar = Sidecar(**fields)
    except (ValueError, TypeError) as e:
        raise ConfigError(
            f"data.path: the sidecar {str(path)!r} is unreadable ({e}); prepare the data again"
        ) from None
    if sidecar.format != FORMAT or sidecar.version != VERSION:
        raise ConfigError(
            f"data.path: {str(path)!r} is not a version {VERSION} {FORMAT} sidecar; prepare the "
            "data again"
        )
    return sidecar


def check_tokenizer(data: Path, sidecar: Sidecar, tokenizer: Tokenizer) -> None:
    """Refuse training or decoding prepared data with another tokenizer than it was made with:
    ids would silently mean other text. Files are compared by content, so a moved tokenizer
    still matches."""
    if sidecar.tokenizer_sha256 == tokenizer.fingerprint:
        return
    raise ConfigError(
        f"data.path {str(data)!r} was prepared with tokenizer {sidecar.tokenizer!r} (vocab "
        f"{sidecar.vocab_size}) but data.tokenizer is {tokenizer.spec!r} (vocab "
        f"{tokenizer.vocab_size}); set data.tokenizer = {sidecar.tokenizer!r}"
    )


def read_loss_mask(data: Path, sidecar: Sidecar | None) -> np.ndarray | None:
    """The loss mask of token file `data` (a read-only uint8 memmap of num_tokens entries, 1 where
    a token counts for the loss), None when its sidecar names none."""
    if sidecar is None or sidecar.loss_mask is None:
        return None
    name = Path(sidecar.loss_mask).name  # beside the token file, never elsewhere
    path = data.with_name(name)
    size = path.stat().st_size if path.is_file() else -1
    if size != sidecar.num_tokens:
        found = "is missing" if size < 0 else f"holds {size} entries"
        raise ConfigError(
            f"data.path {str(data)!r}: its loss mask {str(path)!r} {found}, its sidecar says "
            f"{sidecar.num_tokens} tokens; the files are incomplete or were changed: prepare "
            "them again"
        )
    if size == 0:
        return np.zeros(0, dtype=np.uint8)
    return np.memmap(path, dtype=np.uint8, mode="r")
