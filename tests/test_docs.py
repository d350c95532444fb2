"""The documentation: every config field and command-line option has a help text and appears in
the reference pages generated from the code (docs/gen_reference.py), the site builds with
`mkdocs build --strict` (a broken link or a missing page fails it), and the README stays a short
front door whose links lead to files that exist."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
from pathlib import Path

import pytest

from distrain.config.schema import Config

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def gen():
    spec = importlib.util.spec_from_file_location("gen_reference", ROOT / "docs/gen_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _leaf_fields(node, prefix=""):
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        if dataclasses.is_dataclass(value):
            yield from _leaf_fields(value, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", f


def test_every_config_field_has_help_and_is_in_the_reference(gen):
    fields = dict(_leaf_fields(Config()))
    assert len(fields) > 100
    missing = [name for name, f in fields.items() if not f.metadata.get("help", "").strip()]
    assert not missing, f"config fields without a help text: {missing}"
    page = gen.config_page()
    absent = [name for name in fields if f"| `{name}` |" not in page]
    assert not absent, f"config fields missing from reference/config.md: {absent}"
    assert [fd.name for fd in gen.config_fields()] == list(fields)
    # Ranges come from each field's metadata.
    assert "| `optim.beta1` | `float` | `0.9` | `in [0, 1)` |" in page


def test_every_command_option_has_help_and_is_in_the_reference(gen):
    from distrain.cli import COMMANDS

    parsers = gen.command_parsers()
    assert list(parsers) == list(COMMANDS)
    page = gen.cli_page()
    for name, parser in parsers.items():
        assert f"## `distrain {name}`" in page
        for action in gen.options(parser):
            flag = action.option_strings[0] if action.option_strings else action.metavar
            assert action.help and action.help.strip(), f"distrain {name} {flag}: no help text"
            assert f"`{flag}" in page, f"distrain {name} {flag} missing from reference/cli.md"
    train = {a.option_strings[0] for a in gen.options(parsers["train"])}
    assert {"--config", "--nproc", "--nnodes", "--max-restarts", "--resume"} <= train


def test_the_layout_rule_reference_lists_every_rule(gen):
    from distrain.layout.rules import RULES

    page = gen.layout_rules_page()
    for number, rule in enumerate(RULES, 1):
        assert f"| {number} | `{rule.name}` |" in page


def test_the_site_builds_strictly(tmp_path, monkeypatch):
    monkeypatch.setenv("NO_MKDOCS_2_WARNING", "1")
    from mkdocs.commands.build import build
    from mkdocs.config import load_config

    config = load_config(str(ROOT / "mkdocs.yml"), site_dir=str(tmp_path / "site"), strict=True)
    build(config)  # raises on any warning: a broken link or anchor, a page outside the nav
    for page in ("reference/config", "reference/cli", "reference/layout-rules", "security"):
        assert (tmp_path / "site" / page / "index.html").is_file()
    assert not (tmp_path / "site" / "gen_reference.py").exists()


def test_the_readme_is_short_and_its_links_resolve():
    readme = ROOT / "README.md"
    assert readme.stat().st_size <= 10 * 1024
    text = readme.read_text()
    # .ci/run runs the README's test command.
    assert 'pip install torch==2.13.0 -e ".[dev]" && python -m pytest -q -rs' in text
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
        if "://" not in target:
            assert (ROOT / target).exists(), f"README links to a missing file: {target}"


def test_the_architecture_map_names_every_folder_and_root_module():
    text = (ROOT / "docs/design/architecture.md").read_text()
    tree = text.split("```text\ndistrain/\n", 1)[1].split("```", 1)[0]
    named = {line.split()[0] for line in tree.splitlines() if line.strip()}
    package = ROOT / "distrain"
    want = {p.name + "/" for p in package.iterdir() if (p / "__init__.py").exists()}
    want |= {p.name for p in package.glob("*.py")}
    assert named == want


def test_every_benchmark_table_is_its_committed_json_rendered():
    """Each `<!-- benchmark: NAME -->` block of docs/ is what benchmarks/tables.py renders from
    benchmarks/results/NAME.json (`python3 benchmarks/tables.py` rewrites them), and every JSON
    there backs a page: a figure typed by hand, or a JSON no page quotes, fails here."""
    spec = importlib.util.spec_from_file_location("tables", ROOT / "benchmarks/tables.py")
    tables = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tables)
    named = set()
    for page in tables.pages():
        text = page.read_text()
        for block in tables.blocks(text):
            name = block.group("name")
            assert (tables.RESULTS / f"{name}.json").is_file(), f"{page}: no JSON for {name}"
            assert block.group("body") == tables.render(name), (
                f"{page.relative_to(ROOT)}: the {name} block differs from its JSON; run "
                "python3 benchmarks/tables.py"
            )
            named.add(f"{name}.json")
        named |= set(re.findall(r"benchmarks/results/([\w.-]+\.json)", text))
    assert named, "no page quotes a benchmark record"
    unquoted = {p.name for p in tables.RESULTS.glob("*.json")} - named
    assert not unquoted, f"benchmark records no page quotes: {sorted(unquoted)}"
