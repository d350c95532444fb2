"""Every example config passes `distrain train --check` as written at the world size its first
line states (the user's own files it names, absent here, are listed as not checked), and the
CPU end-to-end script runs: prepare, train, status, generate, export."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import cli_in_process

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
# The fields that point at a user's own files (data, tokenizer, Hugging Face weights).
USER_FILES = ("data.path", "data.tokenizer", "model.init_from")


def _world_size(path: Path) -> int:
    first = path.read_text().splitlines()[0]
    assert first.startswith("# world-size: "), f"{path.name}: state the world size first"
    return int(first.removeprefix("# world-size: "))


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.toml")), ids=lambda p: p.name)
def test_example_config_checks_at_its_world_size(path, tmp_path, capsys):
    world = _world_size(path)
    result = cli_in_process(
        capsys, "train", "--check", "--world-size", str(world), "--config", str(path),
        "--run-dir", str(tmp_path / "run"),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert f"config ok for {world} rank(s)" in result.stdout
    # What --check could not look at is said, one line each, and is only a user's file.
    skipped = [line for line in result.stdout.splitlines() if "not checked" in line]
    for line in skipped:
        assert line.startswith("  not checked (absent here): "), line
        assert line.split(": ", 1)[1].startswith(USER_FILES), line


def test_check_names_what_it_could_not_check(tmp_path, capsys):
    """A config naming a data file, a tokenizer and a Hugging Face folder that are not there:
    --check checks the rest (the rules with the preset's shape) and lists the three; training
    itself refuses the first in one line; a tokenizer that is there but broken is refused."""
    absent = [
        "--data.path", str(tmp_path / "none.bin"),
        "--data.tokenizer", f"hf:{tmp_path / 'no-tokenizer'}",
        "--model.init_from", f"hf:{tmp_path / 'no-model'}",
        "--model.family", "llama", "--model.preset", "llama-tiny",
    ]  # fmt: skip
    checked = cli_in_process(
        capsys, "train", "--check", "--world-size", "2", "--run-dir", str(tmp_path / "run"),
        *absent,
    )  # fmt: skip
    assert checked.returncode == 0, checked.stderr
    notes = [line for line in checked.stdout.splitlines() if "not checked" in line]
    assert len(notes) == 3, checked.stdout
    assert "model.init_from: no config.json in" in notes[0]
    assert "(the rules were checked with model.preset 'llama-tiny')" in notes[0]
    assert "data.tokenizer: no file" in notes[1] and "data.path: no such file" in notes[2]
    trained = cli_in_process(capsys, "train", "--run-dir", str(tmp_path / "run"), *absent)
    assert trained.returncode != 0 and len(trained.stderr.strip().splitlines()) == 1
    (tmp_path / "broken.json").write_text("not a tokenizer")
    broken = cli_in_process(
        capsys, "train", "--check", "--data.tokenizer", f"hf:{tmp_path / 'broken.json'}",
        "--data.path", str(tmp_path / "none.bin"), "--run-dir", str(tmp_path / "run"),
    )  # fmt: skip
    assert broken.returncode != 0 and "broken.json" in broken.stderr


def test_every_example_is_in_the_readme():
    readme = (EXAMPLES / "README.md").read_text()
    for path in EXAMPLES.iterdir():
        if path.name != "README.md":
            assert f"]({path.name})" in readme, path.name


def test_cpu_end_to_end_script(tmp_path):
    env = dict(os.environ, DISTRAIN=f"{sys.executable} -m distrain", PYTHONUNBUFFERED="1")
    result = subprocess.run(
        ["bash", str(EXAMPLES / "cpu-end-to-end.sh"), str(tmp_path / "work")],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "finished 4 steps" in result.stdout + result.stderr
    assert (tmp_path / "work" / "hf" / "config.json").is_file()
    # A second start with another setting names what changed, then resumes from the step
    # asked for (here the newest: nothing newer to delete).
    again = subprocess.run(
        [sys.executable, "-m", "distrain", "train", "--nproc", "1", "--run-dir",
         str(tmp_path / "work" / "run"), "--model.family", "llama", "--model.preset", "llama-tiny",
         "--data.path", str(tmp_path / "work" / "train.bin"), "--training.steps", "6",
         "--training.global_batch_size", "4", "--training.micro_batch_size", "2",
         "--training.seq_len", "64", "--training.eval_interval_steps", "0",
         "--training.compile", "false", "--resume-from", "4"],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    out = again.stdout + again.stderr
    assert again.returncode == 0, out[-3000:]
    assert "field(s) changed since this run dir's previous start: training.steps: 4 -> 6" in out
    assert "resumed from checkpoint step-00000004" in out and "finished 6 steps" in out


def test_mixture_resume_script(tmp_path):
    """The mixture example stops on 2 ranks and resumes on 3; every step's tokens per source
    equal, and every loss matches, an uninterrupted 1-process run of the same config (fp32 sums
    in another order: 1e-5). A resume that restarted a source's stream would change the
    batches after the stop, and so the losses by far more."""
    import torch

    from distrain.config.io import load_config
    from distrain.observe.metrics import read_metrics
    from distrain.train.worker import run_training

    work = tmp_path / "work"
    env = dict(os.environ, DISTRAIN=f"{sys.executable} -m distrain", PYTHONUNBUFFERED="1")
    result = subprocess.run(
        ["bash", str(EXAMPLES / "mixture-resume.sh"), str(work)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-3000:]
    assert "stopped with exit status 75" in out, out[-3000:]
    assert "dp_replicate=3" in out and "finished 12 steps" in out
    stopped = int(out.split("resumed from checkpoint step-")[1].split()[0])
    assert 3 <= stopped < 12
    resumed = {r["step"]: r for r in read_metrics(work / "run" / "metrics.jsonl") if "loss" in r}

    deterministic = torch.are_deterministic_algorithms_enabled()
    try:
        cfg = load_config(work / "mixture.toml", [("run.dir", str(tmp_path / "reference"))])
        run_training(cfg)
    finally:
        torch.use_deterministic_algorithms(deterministic)
    reference = {
        r["step"]: r for r in read_metrics(tmp_path / "reference" / "metrics.jsonl") if "loss" in r
    }
    assert sorted(resumed) == sorted(reference) == list(range(1, 13))
    for step, row in reference.items():
        for name in ("code", "docs", "tests"):
            assert resumed[step][f"data/tokens/{name}"] == row[f"data/tokens/{name}"], step
        assert abs(resumed[step]["loss"] - row["loss"]) < 1e-5 * row["loss"], step
