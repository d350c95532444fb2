"""Data package: corpus readers, split, samples, and the layout-independent resumable loader."""

from __future__ import annotations

import logging
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

from distrain.config.schema import DataConfig
from distrain.data import (
    ByteTokenizer,
    DataError,
    DistributedBatchLoader,
    TokenDataset,
    build_datasets,
    check_data_skew,
    read_corpus,
    skew_message,
    split_tokens,
    val_batches,
)
from distrain.data.corpus import _stdlib_sources, non_text_fraction


def test_tokenizer_round_trip_and_invalid_bytes() -> None:
    tok = ByteTokenizer()
    text = "héllo, wörld ✓"
    ids = tok.encode(text)
    assert tok.vocab_size == 256 and all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == text
    assert tok.decode(ids[:2]) == "h\ufffd"  # half of "é" decodes to the replacement character


def test_read_folder_sorted_by_path_and_glob(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "b.txt").write_bytes(b"BB")
    (tmp_path / "a.txt").write_bytes(b"A")
    (tmp_path / "sub" / "c.txt").write_bytes(b"CCC")
    (tmp_path / "skip.md").write_bytes(b"no")
    tokens = read_corpus(DataConfig(path=str(tmp_path), glob="**/*.txt"))
    assert tokens.dtype == np.uint8
    assert tokens.tobytes() == b"ABBCCC"


def test_read_text_file_and_max_bytes(tmp_path: Path) -> None:
    (tmp_path / "one.txt").write_bytes(b"0123456789")
    (tmp_path / "two.txt").write_bytes(b"abcdefghij")
    assert read_corpus(DataConfig(path=str(tmp_path / "one.txt"))).tobytes() == b"0123456789"
    capped = read_corpus(DataConfig(path=str(tmp_path), max_bytes=13))
    assert capped.tobytes() == b"0123456789abc"
    capped_file = read_corpus(DataConfig(path=str(tmp_path / "one.txt"), max_bytes=4))
    assert capped_file.tobytes() == b"0123"


def test_read_token_files(tmp_path: Path) -> None:
    values = np.arange(1000, dtype=np.uint16) * 7
    values.tofile(tmp_path / "t.bin")
    np.save(tmp_path / "t.npy", values.astype(np.int32))
    raw = read_corpus(DataConfig(path=str(tmp_path / "t.bin"), token_dtype="uint16"))
    assert isinstance(raw, np.memmap) and np.array_equal(raw, values)
    npy = read_corpus(DataConfig(path=str(tmp_path / "t.npy")))
    assert npy.dtype == np.int32 and np.array_equal(npy, values)
    # format=tokens reads a raw file whatever its suffix; format=text reads .bin as bytes.
    values.tofile(tmp_path / "t.dat")
    forced = read_corpus(DataConfig(path=str(tmp_path / "t.dat"), format="tokens"))
    assert np.array_equal(forced, values)
    as_text = read_corpus(DataConfig(path=str(tmp_path / "t.bin"), format="text"))
    assert as_text.dtype == np.uint8 and as_text.size == values.nbytes


def test_read_errors_name_the_field(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(DataError, match=r"data\.path.*nope") as info:
        read_corpus(DataConfig(path=str(missing)))
    assert "\n" not in str(info.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="empty corpus"):
        read_corpus(DataConfig(path=str(tmp_path / "empty")))
    (tmp_path / "odd.bin").write_bytes(b"abc")
    with pytest.raises(DataError, match="data.token_dtype"):
        read_corpus(DataConfig(path=str(tmp_path / "odd.bin"), token_dtype="uint16"))


def test_default_corpus_is_stdlib_source_in_path_order() -> None:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = _stdlib_sources()
    rel = [f.relative_to(root).as_posix() for f in files]
    assert len(files) > 100 and rel == sorted(rel)
    assert all(f.suffix == ".py" for f in files)
    skipped = {"site-packages", "dist-packages"}
    assert not any(skipped & set(f.relative_to(root).parts) for f in files)
    tokens = read_corpus(DataConfig(max_bytes=100))
    assert tokens.tobytes() == files[0].read_bytes()[:100]


def test_split_is_deterministic_disjoint_and_close_to_fraction() -> None:
    tokens = np.zeros(1_000_000, dtype=np.uint8)
    train, val = split_tokens(tokens, 0.1, block_tokens=1000)
    assert (train, val) == split_tokens(tokens, 0.1, block_tokens=1000)
    covered = np.zeros(tokens.size, dtype=np.int64)
    for start, end in train + val:
        covered[start:end] += 1
    assert (covered == 1).all()  # disjoint, and together they cover the corpus
    val_size = sum(end - start for start, end in val)
    assert val_size == 100_000
    assert len(val) == 100  # spread over the corpus, not one block at the end


@pytest.mark.parametrize("num_tokens", [50, 5_000, 150_000])
def test_small_corpora_give_both_splits_data(num_tokens: int) -> None:
    train, val = split_tokens(np.zeros(num_tokens, np.uint8), 0.05, block_tokens=1 << 16)
    train_size = sum(e - s for s, e in train)
    val_size = sum(e - s for s, e in val)
    assert train_size > 0 and val_size > 0 and train_size + val_size == num_tokens
    assert val_size <= 0.1 * num_tokens


def test_token_dataset_windows_across_ranges() -> None:
    tokens = np.arange(100, dtype=np.uint16)
    ds = TokenDataset(tokens, [(0, 10), (20, 21), (30, 50)], seq_len=4)
    # (0,10): windows at 0 and 4; (20,21): none; (30,50): windows at 30, 34, 38, 42.
    assert len(ds) == 6
    assert ds[0].tolist() == [0, 1, 2, 3, 4] and ds[0].dtype == np.int64
    assert ds[2].tolist() == [30, 31, 32, 33, 34]
    assert ds[5].tolist() == [42, 43, 44, 45, 46]
    inputs, targets = ds.get_batch([1, 5])
    assert inputs.dtype == torch.int64 and inputs.shape == (2, 4)
    assert inputs.tolist() == [[4, 5, 6, 7], [42, 43, 44, 45]]
    assert targets.tolist() == [[5, 6, 7, 8], [43, 44, 45, 46]]
    with pytest.raises(IndexError):
        ds[6]


def test_build_datasets_and_too_small_error(tmp_path: Path) -> None:
    (tmp_path / "c.txt").write_bytes(bytes(range(256)) * 40)
    train, val = build_datasets(DataConfig(path=str(tmp_path / "c.txt")), seq_len=16)
    assert len(train) > 10 * len(val) > 0
    with pytest.raises(DataError, match="corpus too small for seq_len 4096"):
        build_datasets(DataConfig(path=str(tmp_path / "c.txt")), seq_len=4096)


def _dataset(num_samples: int = 20, seq_len: int = 3) -> TokenDataset:
    """Samples whose first token is their index, so batches are easy to compare."""
    tokens = np.arange(num_samples * seq_len + 1, dtype=np.int64) // seq_len
    return TokenDataset(tokens, [(0, tokens.size)], seq_len)


def _loader(
    ds: TokenDataset, dp_size: int, micro: int, rank: int, seed: int = 0
) -> DistributedBatchLoader:
    return DistributedBatchLoader(
        ds, global_batch_size=8, micro_batch_size=micro, dp_rank=rank, dp_size=dp_size, seed=seed
    )


def _global_batches(loaders: list[DistributedBatchLoader], steps: int) -> list[torch.Tensor]:
    """Per step: every rank's micro-batch inputs and targets concatenated in rank order."""
    out = []
    for _ in range(steps):
        parts = [mb for loader in loaders for mb in loader.next_batch()]
        out.append(torch.cat([torch.cat([x, y], dim=1) for x, y in parts]))
    return out


def test_ranks_together_read_exactly_the_single_process_batch() -> None:
    ds = _dataset()
    steps = 6  # 48 samples: crosses two epoch boundaries of the 20-sample dataset
    reference = _global_batches([_loader(ds, 1, 8, 0)], steps)
    seen = torch.cat(reference)[:, 0]
    assert sorted(seen[:20].tolist()) == list(range(20))  # epoch 0 visits every sample once
    assert sorted(seen[20:40].tolist()) == list(range(20))
    assert not torch.equal(seen[:20], seen[20:40])  # each epoch has its own order
    for dp_size, micro in [(2, 4), (2, 2), (4, 1), (4, 2)]:
        loaders = [_loader(ds, dp_size, micro, r) for r in range(dp_size)]
        assert loaders[0].accum_steps == 8 // (micro * dp_size)
        batches = _global_batches(loaders, steps)
        for step, (got, want) in enumerate(zip(batches, reference, strict=True)):
            assert torch.equal(got, want), f"dp_size={dp_size} micro={micro} step={step}"


def test_micro_batch_shapes() -> None:
    batches = _loader(_dataset(), 2, 2, 1).next_batch()
    assert len(batches) == 2
    assert all(x.shape == (2, 3) and y.shape == (2, 3) for x, y in batches)
    assert all(x.dtype == torch.int64 and y.dtype == torch.int64 for x, y in batches)


@pytest.mark.parametrize("new_dp_size, new_micro", [(1, 8), (2, 2), (4, 1)])
def test_resume_continues_the_stream_on_any_layout(new_dp_size: int, new_micro: int) -> None:
    ds = _dataset()
    uninterrupted = _global_batches([_loader(ds, 1, 8, 0, seed=3)], 7)
    first = [_loader(ds, 2, 4, r, seed=3) for r in range(2)]
    for got, want in zip(_global_batches(first, 3), uninterrupted[:3], strict=True):
        assert torch.equal(got, want)
    state = first[0].state_dict()
    assert set(state) == {"samples_consumed"} and state["samples_consumed"].dtype == torch.int64
    assert int(state["samples_consumed"]) == 24
    resumed = [_loader(ds, new_dp_size, new_micro, r, seed=3) for r in range(new_dp_size)]
    for loader in resumed:
        loader.load_state_dict(state)
    for got, want in zip(_global_batches(resumed, 4), uninterrupted[3:], strict=True):
        assert torch.equal(got, want)


def test_seeds_change_the_order() -> None:
    ds = _dataset()
    a = _global_batches([_loader(ds, 1, 8, 0, seed=1)], 2)
    b = _global_batches([_loader(ds, 1, 8, 0, seed=2)], 2)
    assert not all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_loader_rejects_indivisible_batch() -> None:
    with pytest.raises(ValueError, match="training.global_batch_size.*micro_batch_size.*data-par"):
        DistributedBatchLoader(
            _dataset(), global_batch_size=8, micro_batch_size=3, dp_rank=0, dp_size=1, seed=0
        )


def test_samples_per_rank_per_epoch() -> None:
    # 20 samples, global 8 over 4 ranks: two full batches (2 each), then 4 left for ranks 0 and 1.
    counts = [_loader(_dataset(), 4, 1, r).samples_per_rank_per_epoch for r in range(4)]
    assert counts == [6, 6, 4, 4] and sum(counts) == 20


@pytest.mark.parametrize(("dp_size", "micro"), [(2, 2), (2, 4), (4, 1)])
def test_val_batches_shard_the_single_process_set(dp_size: int, micro: int) -> None:
    """2 global batches of 4: the same 8 samples for any data-parallel size and micro-batch."""
    ds = _dataset(num_samples=5)  # smaller than the 8 samples asked for: indices wrap
    options = {"num_batches": 2, "global_batch_size": 4}
    whole = val_batches(ds, **options, micro_batch_size=4, dp_rank=0, dp_size=1)
    reference = torch.cat([x for x, _ in whole])
    assert reference[:, 0].tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
    shards = [
        val_batches(ds, **options, micro_batch_size=micro, dp_rank=r, dp_size=dp_size)
        for r in range(dp_size)
    ]
    share = 8 // dp_size
    assert all(len(shard) == share // micro and shard[0][0].shape[0] == micro for shard in shards)
    assert torch.equal(torch.cat([x for shard in shards for x, _ in shard]), reference)


def test_skew_message_decision() -> None:
    assert skew_message([100, 100, 99], max_skew=0.05) is None
    assert skew_message([0, 0], max_skew=0.0) is None
    message = skew_message([6, 6, 4, 4], max_skew=0.05)
    assert message is not None and "\n" not in message
    assert "rank 2: 4" in message and "data.max_skew" in message and "data.skew_action" in message


def test_check_data_skew_without_process_group() -> None:
    assert check_data_skew(7, max_skew=0.05, action="error") == [7]


def test_check_data_skew_actions(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    def fake_all_gather(outputs: list[torch.Tensor], local: torch.Tensor, group=None) -> None:
        for out, value in zip(outputs, [10, 5], strict=True):
            out.fill_(value)

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "all_gather", fake_all_gather)
    with pytest.raises(DataError, match="data skew 0.500"):
        check_data_skew(10, max_skew=0.05, action="error")
    logger = logging.getLogger("test_skew")
    records: list[str] = []
    monkeypatch.setattr(logger, "warning", records.append)
    assert check_data_skew(10, max_skew=0.05, action="warn", logger=logger) == [10, 5]
    assert len(records) == 1 and "rank 1: 5" in records[0]
    with pytest.warns(UserWarning, match="data skew"):
        check_data_skew(10, max_skew=0.05, action="warn")
    assert check_data_skew(10, max_skew=0.6, action="error") == [10, 5]


@pytest.mark.parametrize(
    ("name", "values", "vocab_size", "expected"),
    [
        ("other.bin", np.array([5, 70000, 9], np.int32), 50304,
         "token id 70000 is beyond model.vocab_size 50304 (ids must be < 50304); use data made for "
         "this model's vocabulary, or set model.vocab_size >= 70001"),
        ("neg.npy", np.array([5, -1, 9], np.int32), 256, "token id -1 is negative"),
        ("bytes.txt", np.frombuffer("héllo wörld".encode(), np.uint8), 128,
         "token id 195 is beyond model.vocab_size 128"),
    ],
)  # fmt: skip
def test_token_ids_beyond_the_vocabulary_are_refused(tmp_path, name, values, vocab_size, expected):
    path = tmp_path / name
    np.save(path, values) if name.endswith(".npy") else values.tofile(path)
    cfg = DataConfig(path=str(path), token_dtype="int32")
    with pytest.raises(DataError) as info:
        build_datasets(cfg, 2, vocab_size=vocab_size)
    assert expected in str(info.value) and f"data.path {str(path)!r}" in str(info.value)
    if values.min() >= 0:  # a vocabulary just large enough accepts the same data
        assert read_corpus(cfg, vocab_size=int(values.max()) + 1).size == values.size


def test_token_ids_are_checked_when_training_opens_the_data(tmp_path) -> None:
    from helpers import train_in_process

    path = tmp_path / "other-tokenizer.bin"
    (np.arange(20000, dtype=np.uint16) % 300).tofile(path)  # ids up to 299, tiny's vocab is 256
    with pytest.raises(DataError, match="token id 299 is beyond model.vocab_size 256"):
        train_in_process(tmp_path / "run", data__path=str(path))


@pytest.fixture
def data_warnings(caplog: pytest.LogCaptureFixture):
    """Warnings of the `distrain` logger, whose propagation an earlier run may have turned off."""
    logger = logging.getLogger("distrain")
    logger.addHandler(caplog.handler)
    caplog.set_level(logging.WARNING, logger="distrain")
    yield caplog
    logger.removeHandler(caplog.handler)


def test_binary_file_as_text_warns(data_warnings) -> None:
    binary = Path(sys.executable).resolve()  # an executable: ELF on Linux, Mach-O on macOS
    read_corpus(DataConfig(path=str(binary), max_bytes=1 << 20))
    messages = [r.getMessage() for r in data_warnings.records]
    assert len(messages) == 1
    assert f"data.path {str(binary)!r}: " in messages[0]
    assert "of the sampled bytes are not UTF-8 text (a binary file?)" in messages[0]


def test_text_does_not_warn(tmp_path, data_warnings) -> None:
    (tmp_path / "prose.txt").write_text("Grüße, 世界! naïve café\tdone\n" * 5000)
    read_corpus(DataConfig(path=str(tmp_path / "prose.txt")))
    read_corpus(DataConfig(max_bytes=2_000_000))  # the default corpus: the stdlib's source
    assert data_warnings.records == []


def test_non_text_fraction_measures_invalid_and_control_bytes() -> None:
    text = np.frombuffer(("ab\n" * 100).encode(), np.uint8)
    assert non_text_fraction(text) == 0.0
    half = np.frombuffer(b"ab" * 100 + b"\x00\xff" * 100, np.uint8)  # NUL and an invalid byte
    assert non_text_fraction(half) == 0.5


def test_data_set_smaller_than_a_global_batch_is_refused() -> None:
    with pytest.raises(DataError) as info:
        DistributedBatchLoader(
            _dataset(num_samples=6), global_batch_size=16, micro_batch_size=8, dp_rank=0,
            dp_size=2, seed=0,
        )  # fmt: skip
    assert str(info.value).startswith(
        "the data set is too small: the training split holds 6 sequences of 3 tokens, one global "
        "batch needs 16 (training.global_batch_size)"
    )


def test_the_validation_set_spreads_over_the_whole_split() -> None:
    """training.eval_batches picks its sequences evenly over the whole split, not its first
    ones; "auto" takes the whole split where it is small (whole global batches) and at most
    EVAL_TOKENS tokens of a large one; every data-parallel rank reads its share of that set."""
    from distrain.data.loader import EVAL_TOKENS, val_sample

    two = val_sample(100, num_batches=2, global_batch_size=4, seq_len=3)
    assert two.tolist() == [0, 12, 25, 37, 50, 62, 75, 87]
    assert val_sample(10, num_batches="auto", global_batch_size=4, seq_len=3).tolist() == [
        0, 1, 2, 3, 5, 6, 7, 8,
    ]  # fmt: skip
    assert val_sample(3, num_batches="auto", global_batch_size=4, seq_len=3).tolist() == [
        0, 1, 2, 0,
    ]  # fmt: skip
    large = val_sample(12_264, num_batches="auto", global_batch_size=32, seq_len=128)
    assert len(large) * 128 == EVAL_TOKENS == 131_072
    assert large[0] == 0 and large[-1] >= 12_264 - 12 and len(set(large.tolist())) == len(large)
    assert np.all(np.diff(large) <= 12)  # no part of the split is left out
    ds = _dataset(num_samples=100)
    shards = [
        val_batches(
            ds, num_batches=2, global_batch_size=4, micro_batch_size=2, dp_rank=r, dp_size=2
        )
        for r in range(2)
    ]
    firsts = torch.cat([x for shard in shards for x, _ in shard])[:, 0]
    assert firsts.tolist() == two.tolist()
