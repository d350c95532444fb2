"""The Python API (`import distrain`), used as a library user would: only the names the package
root documents, never a submodule. A config from a file and overrides, a short run of the tiny
preset in this process, what it leaves in the run dir; the preset registry; and that importing
the package loads no torch."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

import distrain

STEPS = 3


def test_a_run_trains_and_checkpoints_through_the_api(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[model]\npreset = "tiny"\n\n[training]\nsteps = 100\nseq_len = 32\n')
    run = tmp_path / "run"
    cfg = distrain.load_config(
        path,
        overrides={
            "run.dir": str(run),
            "training.steps": STEPS,  # over the file's 100
            "training.global_batch_size": 4,
            "training.micro_batch_size": "2",  # text, as on the command line
            "training.log_interval_steps": 1,
            "training.eval_interval_steps": 0,
            "data.max_bytes": 200_000,
            "metrics.progress_bar": False,
            "metrics.tensorboard": False,
            "checkpoint.interval_steps": 0,
            "checkpoint.at_end": True,
        },
    )
    assert isinstance(cfg, distrain.Config)
    assert (cfg.model.preset, cfg.training.seq_len, cfg.training.steps) == ("tiny", 32, STEPS)
    assert cfg.training.micro_batch_size == 2

    distrain.run_training(cfg)

    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    assert all(math.isfinite(r["loss"]) and r["loss"] > 0 for r in steps)
    assert (run / "config.toml").is_file()
    final = run / "checkpoints" / f"step-{STEPS:08d}"
    assert (final / "MANIFEST.json").is_file()
    # The entry survives the training package's import (`distrain.train` is that package).
    assert callable(distrain.run_training)


def test_a_wrong_field_is_a_config_error_naming_it():
    with pytest.raises(distrain.ConfigError, match="training.steps") as caught:
        distrain.load_config(overrides={"training.steps": 2.5})
    assert isinstance(caught.value, distrain.DistrainError)
    with pytest.raises(distrain.ConfigError, match="no such file"):
        distrain.load_config("/nonexistent/run.toml")


def test_the_preset_registry_is_a_copy():
    found = distrain.presets()
    assert {"tiny", "small", "7b"} <= set(found)
    assert {"gpt2", "gpt2-124m"} <= set(distrain.presets("gpt2"))
    assert found["tiny"].n_layers > 0
    found.pop("tiny")
    assert "tiny" in distrain.presets()


def test_the_surface_is_what_the_docstring_documents():
    assert set(dir(distrain)) == set(distrain.__all__)
    for name in distrain.__all__:
        assert f"`{name}" in distrain.__doc__ or name == "__version__", name
        assert getattr(distrain, name) is not None
    with pytest.raises(AttributeError):
        _ = distrain.Trainer


def test_importing_distrain_loads_no_torch():
    code = "import sys, distrain; print(sorted(m for m in sys.modules if m.startswith('torch')))"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
