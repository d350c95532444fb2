"""Files distrain writes into folders others may write too (a run dir, a dataset folder) never
write through a symlink planted at their name or at a temporary name: each is created fresh
(O_EXCL | O_NOFOLLOW) and renamed over the target, which replaces a link instead of following
it, or, for logs and streams, opened with O_NOFOLLOW and refused in one line."""

from __future__ import annotations

import pytest
from helpers import train_in_process

from distrain.data.prepare import prepare
from distrain.files import SymlinkRefused, open_append, write_atomic

RUN = {"training__steps": 2, "training__global_batch_size": 8, "training__micro_batch_size": 8,
       "training__seq_len": 32, "checkpoint__interval_steps": 0}  # fmt: skip


@pytest.fixture
def victim(tmp_path):
    path = tmp_path / "victim.txt"
    path.write_text("precious\n")
    return path


def test_atomic_writes_replace_a_planted_link_and_append_refuses_one(tmp_path, victim):
    target = tmp_path / "folder" / "config.toml"
    target.parent.mkdir()
    target.symlink_to(victim)
    write_atomic(target, "new\n")
    assert victim.read_text() == "precious\n" and not target.is_symlink()
    assert target.read_text() == "new\n"
    log = tmp_path / "folder" / "metrics.jsonl"
    log.symlink_to(victim)
    with pytest.raises(SymlinkRefused, match="metrics.jsonl is a symlink"):
        open_append(log)
    assert victim.read_text() == "precious\n"


def test_a_run_dir_with_planted_links_writes_none_of_their_targets(tmp_path, victim):
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    for name in ("config.toml", ".trackers.json.tmp"):
        (run / name).symlink_to(victim)
    train_in_process(run, **RUN)
    assert victim.read_text() == "precious\n"
    assert not (run / "config.toml").is_symlink()


@pytest.mark.parametrize("name", ["metrics.jsonl", "logs/rank0.log"])
def test_a_planted_stream_link_stops_the_run_in_one_line(tmp_path, victim, name):
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    (run / name).symlink_to(victim)
    with pytest.raises(SymlinkRefused, match=f"{name.split('/')[-1]} is a symlink"):
        train_in_process(run, **RUN)
    assert victim.read_text() == "precious\n"


def test_prepare_writes_through_no_planted_link(tmp_path, victim):
    text = tmp_path / "text"
    text.mkdir()
    (text / "a.txt").write_text("alpha beta gamma " * 200)
    out = tmp_path / "data"
    out.mkdir()
    for name in ("index.json.tmp", "index.json", "shard-00000.bin.tmp"):
        (out / name).symlink_to(victim)
    prepare([str(text)], out=str(out), tokenizer="bytes", shard_tokens=1000)
    assert victim.read_text() == "precious\n"
    assert not (out / "index.json").is_symlink() and (out / "index.json").stat().st_size > 0
