"""Every shipped config in configs/ loads and validates (a file it names that is not on this
machine, a GPU config's data or tokenizer, is only noted as not checked)."""

from pathlib import Path

import pytest

from distrain.config.io import load_config
from distrain.layout.rules import validate

CONFIGS = sorted((Path(__file__).parent.parent / "configs").glob("*.toml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_shipped_config_is_valid(path):
    cfg = load_config(str(path))
    absent: list[str] = []
    validate(cfg, None, absent=absent)
    assert all(note.startswith(("data.tokenizer", "model.init_from")) for note in absent), absent


def test_configs_exist():
    assert {p.stem for p in CONFIGS} >= {"tiny", "gpt2-124m", "1b"}


def test_tiny_config_is_the_default():
    tiny = Path(__file__).parent.parent / "configs" / "tiny.toml"
    assert load_config(str(tiny)) == load_config()
