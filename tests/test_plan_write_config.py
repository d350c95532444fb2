"""`distrain plan --write-config FILE`: the recommended layout, micro-batch and batch as a
config file that `distrain train --check` accepts; a file already there is refused before the
plan runs. A tiny model on 2 nodes of 2 devices (fake builds of a few seconds, in a cache of
the test's own)."""

from __future__ import annotations

import tomllib

from helpers import cli_in_process

QUESTION = ("plan", "--preset", "tiny", "--nodes", "2", "--gpus-per-node", "2")


def test_the_written_layout_is_the_answers_and_train_check_accepts_it(
    tmp_path, capsys, monkeypatch
):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = tmp_path / "chosen.toml"
    args = (*QUESTION, "--gpu-memory", "1GB", "--global-batch", "8", "--seq-len", "64")
    planned = cli_in_process(capsys, *args, "--write-config", str(path))
    assert planned.returncode == 0, planned.stderr
    said = planned.stdout
    assert f"wrote {path}: layout " in said and "--world-size 4`" in said
    written = tomllib.loads(path.read_text())
    p, t = written["parallel"], written["training"]
    layout = next(line for line in said.splitlines() if "set: [parallel]" in line)
    assert f"tp = {p['tp']}, pp = {p['pp']}, zero_stage = {p['zero_stage']}" in layout
    assert f"set: [training] micro_batch_size = {t['micro_batch_size']}" in said
    assert (t["global_batch_size"], t["seq_len"], written["model"]["preset"]) == (8, 64, "tiny")
    checked = cli_in_process(capsys, "train", "--check", "--config", str(path), "--world-size", "4")
    assert checked.returncode == 0, checked.stderr
    assert "config ok for 4 rank(s)" in checked.stdout
    before = path.read_text()
    again = cli_in_process(capsys, *args, "--write-config", str(path))
    assert again.returncode != 0 and "a file is there already" in again.stderr
    assert path.read_text() == before and "plan for:" not in again.stdout
