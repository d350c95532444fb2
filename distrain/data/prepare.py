"""`distrain prepare`: tokenize text files, folders, JSONL files and saved Hugging Face datasets
into a prepared token file (see tokfile.py), or with `shard_tokens` into a sharded dataset folder
(see shards.py, shard_writer.py), in parallel worker processes, with a progress bar.

The inputs are cut into units of work (a text file, a newline-aligned byte range of a JSONL file,
a row range of a dataset) in a fixed order; workers tokenize units and the parent writes their
tokens in unit order, so the output does not depend on the number of processes. A text file is
one document, as are a JSONL line's and a dataset row's `--field` text.

JSONL of conversations (records with `messages`, or `prompt` and `completion`: chat.py) is
rendered with the tokenizer folder's chat template, each conversation one document, and the loss
mask (which tokens count for the loss) is written beside the tokens (DATA.bin.mask).
"""

from __future__ import annotations

import hashlib
import io
import json
import multiprocessing
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
from tqdm import tqdm

from distrain.data.chat import ChatRenderer, LossOn, is_conversation
from distrain.data.corpus import INDEX_NAME
from distrain.data.shard_writer import ShardWriter
from distrain.data.shards import ShardIndex
from distrain.data.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer
from distrain.data.tokfile import (
    Sidecar,
    docs_path,
    mask_path,
    sidecar_path,
    token_dtype,
    write_sidecar,
)
from distrain.errors import ConfigError
from distrain.files import open_new, write_atomic

JSONL_SUFFIXES = (".jsonl", ".ndjson")
UNIT_BYTES = 4 << 20
UNIT_ROWS = 1024


@dataclass(frozen=True)
class Unit:
    """One piece of work: a whole text file, bytes [start, stop) of a JSONL file, or rows
    [start, stop) of a saved dataset (split `split`). `weight` is its share of the progress bar,
    in bytes."""

    kind: Literal["text", "jsonl", "dataset"]
    path: str
    start: int = 0
    stop: int = 0
    split: str = ""
    weight: int = 0


@dataclass(frozen=True)
class Prepared:
    sidecar: Sidecar
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.sidecar.num_tokens / self.seconds if self.seconds > 0 else 0.0


def prepare(
    inputs: list[str],
    *,
    out: str,
    tokenizer: str,
    field: str = "text",
    glob: str = "**/*",
    split: str = "train",
    eos: str | None = None,
    workers: int = 1,
    progress: bool = False,
    shard_tokens: int = 0,
    chat_template: str | None = None,
    loss_on: LossOn = "assistant",
) -> Prepared:
    """Tokenize `inputs` into `out` (+ its sidecar and document boundaries), or with
    `shard_tokens` > 0 into the dataset folder `out`; see the module doc. Conversations are
    rendered with `chat_template` (a file; default: the tokenizer folder's template), and the
    tokens of `loss_on` count for the loss."""
    start_time = time.perf_counter()
    out_path = Path(out)
    if shard_tokens < 0:
        raise ConfigError(f"--shard-tokens must be >= 0, got {shard_tokens}")
    if shard_tokens and out_path.suffix == ".bin":
        raise ConfigError(f"--out {out!r}: with --shard-tokens, --out names a folder, not a .bin")
    if not shard_tokens and out_path.suffix != ".bin":
        raise ConfigError(
            f"--out {out!r} must end in .bin (training reads .bin as tokens), or be a folder "
            "with --shard-tokens N"
        )
    if workers < 1:
        raise ConfigError(f"--workers must be >= 1, got {workers}")
    tok = load_tokenizer(tokenizer, "--tokenizer")
    eos_id = None
    if eos is not None:
        eos_id = tok.token_id(eos)
        if eos_id is None:
            raise ConfigError(f"--eos {eos!r} is not a token of --tokenizer {tokenizer!r}")
    units = list(_units(inputs, out_path, field=field, glob=glob, split=split))
    if not units:
        raise ConfigError(f"no input documents found in {inputs} (--glob {glob!r})")
    chat = _is_chat(units, field)
    if chat_template is not None and not chat:
        raise ConfigError(
            f"--chat-template: the inputs are not conversations (JSONL records with "
            f"'messages', or 'prompt' and 'completion', and no {field!r})"
        )
    if chat:
        if shard_tokens:
            raise ConfigError(
                "--shard-tokens: conversations are prepared into one token file (DATA.bin, with "
                "its loss mask); drop --shard-tokens"
            )
        if eos is not None:
            raise ConfigError(
                "--eos: conversations end with the chat template's own tokens; drop --eos"
            )
        if any(u.kind != "jsonl" for u in units):
            raise ConfigError(
                "prepare: conversations come from JSONL files only; prepare text and "
                "conversations into separate token files"
            )
        ChatRenderer(tokenizer, chat_template, loss_on)  # its refusals, before any worker
    dtype = token_dtype(tok.vocab_size)
    # One process uses one core: --workers alone sets the parallelism (tokenizers' own thread
    # pool would otherwise also take every core, in each worker).
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    setup = (tokenizer, field, eos_id, dtype.str, (chat_template, loss_on) if chat else None)
    if shard_tokens:
        return _prepare_shards(
            units, setup, tok, out_path, shard_tokens, eos_id, workers, progress, start_time
        )
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(out_path.name + ".tmp")
    mask_tmp = mask_path(out_path).with_name(mask_path(out_path).name + ".tmp")
    lengths: list[np.ndarray] = []
    bar = tqdm(
        total=sum(u.weight for u in units),
        desc="prepare",
        unit="B",
        unit_scale=True,
        disable=not (progress and sys.stderr.isatty()),
    )
    num_tokens = 0
    try:
        with (
            open_new(tmp, "wb") as sink,
            open_new(mask_tmp, "wb") if chat else io.BytesIO() as mask_sink,
            bar,
        ):
            results = _results(units, setup, workers)
            for unit, (tokens, doc_lengths, mask) in zip(units, results, strict=True):
                tokens.tofile(sink)
                if mask is not None:
                    mask_sink.write(mask.tobytes())
                lengths.append(doc_lengths)
                num_tokens += tokens.size
                bar.update(unit.weight)
                bar.set_postfix(tokens=num_tokens, refresh=False)
    except BaseException:
        tmp.unlink(missing_ok=True)
        mask_tmp.unlink(missing_ok=True)
        raise
    doc_lengths = np.concatenate(lengths)
    boundaries = np.concatenate([[0], np.cumsum(doc_lengths, dtype=np.int64)])
    tmp.replace(out_path)
    if chat:
        mask_tmp.replace(mask_path(out_path))
    docs = io.BytesIO()
    np.save(docs, boundaries)
    write_atomic(docs_path(out_path), docs.getvalue())
    sidecar = Sidecar(
        tokenizer=tok.spec,
        tokenizer_sha256=tok.fingerprint,
        vocab_size=tok.vocab_size,
        dtype=dtype.name,
        num_tokens=num_tokens,
        num_documents=int(doc_lengths.size),
        eos_id=eos_id,
        loss_mask=mask_path(out_path).name if chat else None,
    )
    write_sidecar(out_path, sidecar)  # last: a token file with a sidecar is complete
    return Prepared(sidecar, time.perf_counter() - start_time)


def _prepare_shards(
    units: list[Unit],
    setup: tuple,
    tok: Tokenizer,
    out: Path,
    shard_tokens: int,
    eos_id: int | None,
    workers: int,
    progress: bool,
    start_time: float,
) -> Prepared:
    """The sharded variant of `prepare`: units from where an earlier run of this job stopped."""
    dtype = np.dtype(setup[3])
    job = hashlib.sha256(
        json.dumps([[asdict(u) for u in units], tok.fingerprint, setup[1:], shard_tokens]).encode()
    ).hexdigest()
    writer = ShardWriter(out, shard_tokens=shard_tokens, job=job, dtype=dtype)
    todo = units[writer.resume_unit :]
    bar = tqdm(
        total=sum(u.weight for u in todo),
        desc="prepare",
        unit="B",
        unit_scale=True,
        disable=not (progress and sys.stderr.isatty()),
    )
    try:
        with bar:
            results = _results(todo, setup, workers)
            for i, (unit, (tokens, lengths, _)) in enumerate(zip(todo, results, strict=True)):
                writer.add(writer.resume_unit + i, tokens, lengths)
                bar.update(unit.weight)
    except BaseException:
        writer.abort()
        raise
    index = writer.finish(
        ShardIndex(
            tokenizer=tok.spec,
            tokenizer_sha256=tok.fingerprint,
            vocab_size=tok.vocab_size,
            dtype=dtype.name,
            eos_id=eos_id,
            shard_tokens=shard_tokens,
            shards=(),
        )
    )
    sidecar = Sidecar(
        tokenizer=tok.spec,
        tokenizer_sha256=tok.fingerprint,
        vocab_size=tok.vocab_size,
        dtype=dtype.name,
        num_tokens=index.num_tokens,
        num_documents=sum(s.num_documents for s in index.shards),
        eos_id=eos_id,
    )
    return Prepared(sidecar, time.perf_counter() - start_time)


def _results(
    units: list[Unit], setup: tuple, workers: int
) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray | None]]:
    if workers == 1:
        _init_worker(*setup)
        yield from map(_tokenize_unit, units)
        return
    # forkserver, with this module preloaded in the server: workers are forked from a process
    # that has imported what they need (spawn would import torch again in each, seconds apiece)
    # but has started no thread, so none of the caller's threads' locks (logging, tqdm's
    # monitor, tokenizers' and Arrow's pools, a process group's) can be held in a worker.
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    with ctx.Pool(workers, initializer=_init_worker, initargs=setup) as pool:
        yield from pool.imap(_tokenize_unit, units, chunksize=4)


# --- the inputs, cut into units (parent) ---


def _is_chat(units: list[Unit], field: str) -> bool:
    """The inputs are conversations: the first record of the first JSONL input is one (and has
    no `field`, which would make it a text record)."""
    for unit in units:
        if unit.kind != "jsonl":
            continue
        with open(unit.path, "rb") as f:
            f.seek(unit.start)
            for line in f:
                if line.strip():
                    try:
                        record = json.loads(line)
                    except ValueError:
                        return False  # the reader names the line
                    return is_conversation(record) and field not in record
        return False
    return False


def _units(inputs: list[str], out: Path, *, field: str, glob: str, split: str) -> Iterator[Unit]:
    produced = {p.resolve() for p in (out, docs_path(out), sidecar_path(out))}
    if out.is_dir():
        produced |= {
            p.resolve() for p in out.iterdir() if p.name.startswith(("shard-", INDEX_NAME))
        }
    for name in inputs:
        path = Path(name).expanduser()
        if not path.exists():
            raise ConfigError(f"prepare: no such input file or folder {name!r}")
        if path.is_dir() and _is_saved_dataset(path):
            yield from _dataset_units(path, field, split)
        elif path.is_dir():
            files = sorted(p for p in path.glob(glob) if p.is_file())
            for file in files:
                if file.resolve() not in produced:
                    yield from _file_units(file)
        else:
            yield from _file_units(path)


def _file_units(file: Path) -> Iterator[Unit]:
    size = file.stat().st_size
    if file.suffix not in JSONL_SUFFIXES:
        yield Unit("text", str(file), weight=size)
        return
    with open(file, "rb") as f:
        start = 0
        while start < size:
            f.seek(min(start + UNIT_BYTES, size))
            f.readline()  # to the end of the line the cut falls in
            stop = min(f.tell(), size)
            yield Unit("jsonl", str(file), start, stop, weight=stop - start)
            start = stop


def _is_saved_dataset(path: Path) -> bool:
    """A folder written by datasets' save_to_disk (a Dataset, or a DatasetDict of splits)."""
    return (path / "state.json").is_file() or (path / "dataset_dict.json").is_file()


def _dataset_units(path: Path, field: str, split: str) -> Iterator[Unit]:
    ds = _dataset_split(str(path), split)
    if field not in ds.column_names:
        raise ConfigError(
            f"--field {field!r}: the dataset {str(path)!r} has no such column (columns: "
            f"{', '.join(ds.column_names)})"
        )
    rows = ds.num_rows
    row_bytes = ds.data.nbytes / max(rows, 1)
    for start in range(0, rows, UNIT_ROWS):
        stop = min(start + UNIT_ROWS, rows)
        yield Unit("dataset", str(path), start, stop, split, int(row_bytes * (stop - start)))


def _dataset_split(path: str, split: str) -> Any:
    try:
        import datasets
    except ImportError:
        raise ConfigError(
            "prepare: a saved dataset needs the datasets package; pip install datasets"
        ) from None
    loaded = datasets.load_from_disk(path)
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise ConfigError(
                f"--split {split!r}: the dataset {path!r} has splits {', '.join(loaded)}; "
                "choose one"
            )
        return loaded[split]
    return loaded


# --- tokenizing a unit (worker) ---

_worker: dict[str, Any] = {}


def _init_worker(
    spec: str, field: str, eos_id: int | None, dtype: str, chat: tuple[str | None, LossOn] | None
) -> None:
    _worker.update(
        chat=None if chat is None else ChatRenderer(spec, *chat),
        tokenizer=load_tokenizer(spec, "--tokenizer"),
        field=field,
        eos_id=eos_id,
        dtype=np.dtype(dtype),
        datasets={},
    )


def _tokenize_unit(unit: Unit) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(the unit's tokens, one length per document, the loss mask of conversations or None),
    documents in input order."""
    if _worker["chat"] is not None:
        return _render_unit(unit)
    texts = _read_unit(unit)
    tok: Tokenizer = _worker["tokenizer"]
    ids = tok.encode_batch(texts) if not isinstance(tok, ByteTokenizer) else map(tok.encode, texts)
    eos = [] if _worker["eos_id"] is None else [_worker["eos_id"]]
    docs = [np.asarray(doc + eos, dtype=_worker["dtype"]) for doc in ids]
    lengths = np.fromiter((d.size for d in docs), dtype=np.int64, count=len(docs))
    tokens = np.concatenate(docs) if docs else np.zeros(0, _worker["dtype"])
    return tokens, lengths, None


def _render_unit(unit: Unit) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    renderer: ChatRenderer = _worker["chat"]
    ids: list[int] = []
    mask: list[int] = []
    lengths = []
    for record, where in _jsonl_records(unit):
        if not is_conversation(record):
            raise ConfigError(
                f"prepare: {unit.path}: {where} is no conversation (a record with 'messages', "
                "or 'prompt' and 'completion'), as the first record is"
            )
        doc, doc_mask = renderer.render(record, f"{unit.path}: {where}")
        ids += doc
        mask += doc_mask
        lengths.append(len(doc))
    return (
        np.asarray(ids, dtype=_worker["dtype"]),
        np.asarray(lengths, dtype=np.int64),
        np.asarray(mask, dtype=np.uint8),
    )


def _read_unit(unit: Unit) -> list[str]:
    if unit.kind == "text":
        return [Path(unit.path).read_bytes().decode("utf-8", errors="replace")]
    if unit.kind == "jsonl":
        return _read_jsonl(unit)
    cache = _worker["datasets"]
    key = (unit.path, unit.split)
    if key not in cache:
        cache[key] = _dataset_split(unit.path, unit.split)
    values = cache[key][unit.start : unit.stop][_worker["field"]]
    return [_as_text(v, unit.path, f"row {unit.start + i}") for i, v in enumerate(values)]


def _jsonl_records(unit: Unit) -> Iterator[tuple[Any, str]]:
    """(record, where) of each non-blank line of a JSONL unit."""
    with open(unit.path, "rb") as f:
        f.seek(unit.start)
        data = f.read(unit.stop - unit.start)
    offset = unit.start
    for line in data.splitlines(keepends=True):
        where = f"the line at byte {offset}"
        offset += len(line)
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as e:
            raise ConfigError(f"prepare: {unit.path}: {where} is not JSON ({e})") from None
        yield record, where


def _read_jsonl(unit: Unit) -> list[str]:
    field = _worker["field"]
    texts = []
    for record, where in _jsonl_records(unit):
        if not isinstance(record, dict) or field not in record:
            raise ConfigError(
                f"--field {field!r}: {unit.path}: {where} has no such key; name the text field "
                "with --field"
            )
        texts.append(_as_text(record[field], unit.path, where))
    return texts


def _as_text(value: object, path: str, where: str) -> str:
    if not isinstance(value, str):
        raise ConfigError(
            f"--field {_worker['field']!r}: {path}: {where} holds {type(value).__name__}, not "
            "text; name a text field with --field"
        )
    return value
