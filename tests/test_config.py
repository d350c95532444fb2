"""Config: TOML + dotted overrides, validation messages that name the field, resolved output."""

import tomllib

import pytest

from distrain.config.io import help_text, load_config, parse_overrides, write_toml
from distrain.config.schema import ConfigError


def test_defaults_validate():
    cfg = load_config()
    assert cfg.training.global_batch_size % cfg.training.micro_batch_size == 0


def test_toml_then_overrides_win(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[training]\nsteps = 50\nseq_len = 64\n[optim]\nlr = 1e-3\n")
    cfg = load_config(str(path), parse_overrides(["--training.steps", "200", "--optim.lr=3e-4"]))
    assert (cfg.training.steps, cfg.training.seq_len, cfg.optim.lr) == (200, 64, 3e-4)


def test_toml_int_accepted_for_float(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[optim]\nlr = 1\n")
    assert load_config(str(path)).optim.lr == 1.0


def test_micro_batch_size_auto_round_trips(tmp_path):
    """'auto' is a value of micro_batch_size in TOML and on the command line; a global batch
    that no fixed micro-batch splits is left to the trainer's choice."""
    path = tmp_path / "c.toml"
    path.write_text('[training]\nmicro_batch_size = "auto"\nmemory_budget_gb = 1.5\n')
    cfg = load_config(str(path), parse_overrides(["--training.global_batch_size", "7"]))
    assert (cfg.training.micro_batch_size, cfg.training.memory_budget_gb) == ("auto", 1.5)
    write_toml(cfg, tmp_path / "resolved.toml")
    assert load_config(str(tmp_path / "resolved.toml")) == cfg
    assert load_config(None, [("training.micro_batch_size", "AUTO")]).training.micro_batch_size == (
        "auto"
    )
    assert load_config(None, [("training.micro_batch_size", "4")]).training.micro_batch_size == 4


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--training.stepz", "3"], "field 'training.stepz'; did you mean 'training.steps'?"),
        (["--training.zzz", "3"], "unknown config field 'training.zzz'; training has: steps"),
        (["--nosuch.steps", "3"], "unknown config field 'nosuch.steps'; sections are: run"),
        (["--training.steps", "many"], "training.steps: expected int, got 'many'"),
        (["--training.precision", "fp8"], "choose one of fp32 | bf16 | fp16"),
        (["--training.micro_batch_size", "3"], "multiple of training.micro_batch_size (3)"),
        (["--training.steps", "0"], "training.steps = 0 is out of range: it must be >= 1"),
        (["steps=3"], "unrecognized argument 'steps=3'"),
        (["--training.steps"], "--training.steps: missing value"),
    ],
)
def test_bad_overrides_name_the_field(args, expected):
    with pytest.raises(ConfigError) as info:
        load_config(None, parse_overrides(args))
    assert expected in str(info.value)
    assert "\n" not in str(info.value)


def test_toml_wrong_type_names_field(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[training]\nsteps = "ten"\n')
    with pytest.raises(ConfigError, match="training.steps: expected int, got 'ten'"):
        load_config(str(path))
    path.write_text("[training]\ndeterministic = 1\n")
    with pytest.raises(ConfigError, match="training.deterministic: expected bool"):
        load_config(str(path))


@pytest.mark.parametrize(
    ("old", "new", "value"),
    [
        ("debug.collective_timeout_s", "comm.collective_timeout_s", 30),
        ("debug.hang_timeout_s", "watchdog.hang_timeout_s", 30),
        ("debug.straggler_ratio", "watchdog.straggler_ratio", 2.0),
    ],
)
def test_a_moved_field_names_its_new_place(tmp_path, old, new, value):
    """A field that left [debug] is refused under its old name, in TOML and on the command
    line, with one line naming the new field; the new name takes the value."""
    expected = f"config field {old!r} is now {new!r}; write that"
    with pytest.raises(ConfigError) as info:
        load_config(None, parse_overrides([f"--{old}", str(value)]))
    assert str(info.value) == expected
    section, field = old.split(".")
    path = tmp_path / "c.toml"
    path.write_text(f"[{section}]\n{field} = {value}\n")
    with pytest.raises(ConfigError) as info:
        load_config(str(path))
    assert str(info.value) == expected
    section, field = new.split(".")
    cfg = load_config(None, parse_overrides([f"--{new}", str(value)]))
    assert getattr(getattr(cfg, section), field) == value


def test_missing_config_file():
    with pytest.raises(ConfigError, match="--config: no such file"):
        load_config("/nonexistent/x.toml")


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(None, parse_overrides(["--model.n_layers", "2", "--training.seed", "7"]))
    write_toml(cfg, tmp_path / "config.toml")
    data = tomllib.loads((tmp_path / "config.toml").read_text())
    assert data["model"]["n_layers"] == 2 and "dim" not in data["model"]
    again = load_config(str(tmp_path / "config.toml"))
    assert again == cfg


def test_help_lists_every_field_with_its_doc():
    text = help_text()
    for name in ("training.global_batch_size", "optim.max_grad_norm", "checkpoint.interval_steps"):
        assert name in text
    assert "Sequences per optimizer step" in text
