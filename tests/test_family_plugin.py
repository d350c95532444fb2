"""A model family from outside distrain (tests/plugins/distrain_residual_mlp/), installed as a
user's package is, through its `distrain.model_families` entry point, trains from a TOML config
(`model.family = "residual_mlp"`) with `distrain train` and no edit to distrain: at parity with
one process under dp2 and tp2 on 2 torchrun workers, each of which finds the family by its entry
point. Its own `model.*` fields apply; a GPT field is refused before launch."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
from distrain_residual_mlp.model import ResidualMLPLM
from distrain_residual_mlp.spec import PRESETS, SPEC
from helpers import cli_in_process, losses, overrides, run_cli
from test_parity import REL_TOL

from distrain.observe.metrics import read_metrics

PLUGINS = Path(__file__).parent / "plugins"

CONFIG = """\
[model]
family = "residual_mlp"
preset = "rmlp-tiny"
ffn_dim = 96

[training]
steps = 4
global_batch_size = 8
micro_batch_size = 2
seq_len = 32
precision = "fp32"
compile = false
deterministic = true
seed = 3

[parallel]
sequence_parallel = false

[optim]
lr = 0.01
warmup_steps = 0
"""


def _site(root: Path, *, entry_point: bool) -> str:
    """A PYTHONPATH holding the family's package and, with `entry_point`, the metadata pip
    writes when it installs a distribution declaring the entry point."""
    if entry_point:
        info = root / "distrain_residual_mlp-0.1.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(
            "Metadata-Version: 2.1\nName: distrain-residual-mlp\nVersion: 0.1\n"
        )
        (info / "entry_points.txt").write_text(
            "[distrain.model_families]\nresidual_mlp = distrain_residual_mlp.spec:SPEC\n"
        )
    return os.pathsep.join([str(PLUGINS), str(root)])


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("config") / "residual_mlp.toml"
    path.write_text(CONFIG)
    return path


@pytest.fixture(scope="module")
def plugin_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return _site(tmp_path_factory.mktemp("site"), entry_point=True)


def _train(config: Path, run_dir: Path, nproc: int, *extra: str):
    args = ["train", "--config", str(config), "--nproc", str(nproc), *extra]
    for key, value in overrides(run_dir):
        args += [f"--{key}", value]
    return run_cli(*args)


@pytest.mark.slow
def test_a_plugin_family_trains_from_its_toml_at_parity_under_dp_and_tp(
    config, plugin_path, tmp_path, monkeypatch
):
    monkeypatch.setenv("PYTHONPATH", plugin_path)
    runs = {
        "one_process": (1, ()),
        "dp2": (2, ()),
        "tp2": (2, ("--parallel.tp", "2")),
    }
    got = {}
    for name, (nproc, extra) in runs.items():
        result = _train(config, tmp_path / name, nproc, *extra)
        assert result.returncode == 0, result.stderr[-3000:]
        got[name] = losses(read_metrics(tmp_path / name / "metrics.jsonl"))
    want = got.pop("one_process")
    assert sorted(want) == [1, 2, 3, 4] and want[4] < want[1]  # it trains
    for name, curve in got.items():
        assert curve.keys() == want.keys(), name
        worst = max(abs(curve[s] - want[s]) / want[s] for s in want)
        assert worst <= REL_TOL, (name, curve, want)
    # The family's own count, of its preset with the TOML's model.ffn_dim (its MLP's hidden).
    widened = SPEC.num_params(dataclasses.replace(PRESETS["rmlp-tiny"], hidden=96))
    assert widened != SPEC.num_params(PRESETS["rmlp-tiny"])
    log = (tmp_path / "one_process" / "logs" / "rank0.log").read_text()
    assert f"model rmlp-tiny: {widened / 1e6:.2f}M parameters" in log


def test_the_family_comes_from_its_entry_point_and_lists_its_presets(config, plugin_path, tmp_path):
    env = dict(os.environ, PYTHONPATH=plugin_path)
    listed = run_cli("presets", env=env)
    assert listed.returncode == 0, listed.stderr
    rows = [line.split() for line in listed.stdout.splitlines()[1:]]
    counts = {row[1]: int(row[2].replace(",", "")) for row in rows if row[0] == "residual_mlp"}
    built = {
        name: sum(p.numel() for p in ResidualMLPLM(args).parameters())
        for name, args in PRESETS.items()
    }
    assert counts == built == {name: SPEC.num_params(a) for name, a in PRESETS.items()}
    # train --check resolves the family's model from the TOML, its fields applied.
    checked = run_cli("train", "--config", str(config), "--check", "--world-size", "2", env=env)
    assert checked.returncode == 0, checked.stderr
    assert "model: residual_mlp rmlp-tiny, dim 32, 4 layers, hidden 96, vocab 256" in (
        checked.stdout
    )
    # The package importable but not installed: no entry point, no family.
    bare = dict(os.environ, PYTHONPATH=_site(tmp_path, entry_point=False))
    refused = run_cli("train", "--model.family", "residual_mlp", env=bare)
    assert refused.returncode != 0
    assert "model.family: unknown model family 'residual_mlp'; choose one of gpt" in (
        refused.stderr
    )


def test_a_field_the_family_does_not_read_is_refused_before_launch(
    config, plugin_path, tmp_path, monkeypatch
):
    monkeypatch.setenv("PYTHONPATH", plugin_path)
    result = _train(config, tmp_path / "run", 2, "--model.n_heads", "4")
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("distrain: error:")]
    assert (
        len(errors) == 1
        and "model.n_heads does not apply to model.family = 'residual_mlp'" in (errors[0])
    ), result.stderr
    assert "reads model.dim, model.ffn_dim, model.max_seq_len" in errors[0]
    assert not (tmp_path / "run" / "logs").exists()  # no worker started


@pytest.mark.parametrize("name", ["qwen9", "distrain_residual_mlp.spec:SPEC", "os:system"])
def test_an_unknown_family_is_named_with_the_choices(name, capsys, tmp_path):
    """A config chooses among installed families: a module path is not one, nothing imported."""
    result = cli_in_process(capsys, "train", "--model.family", name, "--run.dir", str(tmp_path))
    assert result.returncode != 0
    assert f"model.family: unknown model family {name!r}; choose one of gpt" in result.stderr


def test_an_entry_point_naming_no_model_spec_is_refused(tmp_path, monkeypatch):
    """A distribution whose distrain.model_families entry point names something other than a
    ModelSpec of its own name is refused in one line, not registered."""
    import importlib

    from distrain.errors import ConfigError
    from distrain.models.registry import FAMILIES, model_family

    info = tmp_path / "bogus_family-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: bogus-family\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[distrain.model_families]\nbogus = os:sep\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    with pytest.raises(ConfigError, match="entry point 'bogus' = 'os:sep' must name a ModelSpec"):
        model_family("bogus")
    assert "bogus" not in FAMILIES
