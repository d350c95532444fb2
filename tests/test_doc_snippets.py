"""Every command and config block of the README, docs/ and examples/README.md, checked as
written: a page that shows a command or a config that would fail fails here instead.

What each kind of snippet must do (a snippet is a test case named `page:line`):
- `distrain train ...`: pass `train --check` as written (the layout rules and the preflight on
  the world size its launch options give; files absent on this machine are noted by --check,
  not errors), from the repository root;
- `distrain slurm ...`: print its script (`--dry-run`, added when the page submits);
- `distrain plan ...`: its config built and checked the way the planner does before it plans
  (the layout search itself is tests/test_plan_model.py's);
- `distrain presets`: run;
- every other `distrain` command (it reads a run directory or files the page assumes): its
  arguments accepted by the command's own parser;
- `python3 benchmarks/NAME.py ...`: its arguments accepted by the script's parser;
- `python -c ...`: run;
- `pip install ...`: the torch pin is pyproject's, every extra named exists;
- a launcher around a distrain command (`torchrun`, `srun`): the distrain command inside it is
  checked as above;
- a TOML block: `train --check` of it as a config file on the world size its [parallel] degrees
  give, or, for a pyproject.toml fragment, the entry-point group distrain reads;
- a Python block: run, with `run_training` checking its config (`train --check`'s checks)
  instead of training.
What is run elsewhere is named, not run twice (`COVERED`, and `RUN_IN_ORDER`: a page whose
commands use each other's outputs, all run in order by the test it names); commands of other
tools are named too (`OTHER_TOOLS`): every snippet is one or the other, or the test fails.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import runpy
import shlex
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.requirements import Requirement

import distrain
from distrain.cli import COMMANDS, main

ROOT = Path(__file__).resolve().parent.parent
PAGES = [
    ROOT / "README.md",
    ROOT / "examples" / "README.md",
    *sorted((ROOT / "docs").rglob("*.md")),
]

# Commands another test or CI itself runs as written.
COVERED = {
    "bash examples/cpu-end-to-end.sh": "tests/test_examples.py::test_cpu_end_to_end_script",
    "bash examples/mixture-resume.sh": "tests/test_examples.py::test_mixture_resume_script",
    "python -m pytest": ".ci/run (the README's test command)",
    "mkdocs build": "tests/test_docs.py::test_the_site_builds_strictly",
    # Its --dry-run; the run itself needs a CUDA GPU.
    "bash benchmarks/gpu.sh": "tests/test_gpu_script.py::test_gpu_dry_run_records_every_stage",
}
# Pages whose commands build on each other's outputs (a model folder, a run, an export): the
# named test runs every command of the page, in order, as written, on files it makes; the
# per-snippet checks above would find those outputs missing.
RUN_IN_ORDER = {
    "docs/guides/fine-tuning.md": "tests/test_fine_tuning_guide.py::test_the_guide_runs_as_written",
}
# Commands of other tools a page shows next to distrain's (nothing of distrain to check).
OTHER_TOOLS = {"chmod", "export", "openssl", "wandb"}
LAUNCHERS = {"torchrun", "srun"}
COMMAND_START = re.compile(r"^(distrain|python3?|pip|torchrun|srun|bash|mkdocs|export|openssl)\s")


@dataclass(frozen=True)
class Snippet:
    page: Path
    line: int
    kind: str  # "shell", "toml" or "python"
    text: str

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def _blocks(page: Path) -> list[Snippet]:
    """The page's code: fenced blocks by their language, and indented blocks' command lines
    (an admonition's indented prose is not code)."""
    lines = page.read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        line = lines[i]
        fence = re.match(r"^(\s*)```(\w*)", line)
        if fence:
            start, lang = i + 1, fence.group(2)
            i += 1
            while not lines[i].strip().startswith("```"):
                i += 1
            body = "\n".join(text[len(fence.group(1)) :] for text in lines[start:i])
            if lang in ("toml", "python"):
                out.append(Snippet(page, start + 1, lang, body))
            elif lang == "" and not body.startswith("#!"):  # a script shown is output
                out += _commands(page, start, lines[start:i])
            i += 1
            continue
        if line.startswith("    ") and not _in_admonition(lines, i):
            start = i
            while i < len(lines) and (lines[i].startswith("    ") or not lines[i].strip()):
                i += 1
            out += _commands(page, start, lines[start:i])
            continue
        i += 1
    return out


def _in_admonition(lines: list[str], i: int) -> bool:
    """Whether line i is inside an admonition (`!!! note`) or a list item's indented text."""
    for j in range(i - 1, -1, -1):
        if not lines[j].strip() or lines[j].startswith("    "):
            continue
        return bool(re.match(r"^(!!!|\?\?\?|\s*[-*] |\s*\d+\. )", lines[j]))
    return False


def _commands(page: Path, start: int, block: list[str]) -> list[Snippet]:
    """The shell commands of a block (continuation lines joined), with their line numbers."""
    out, pending, first = [], "", 0
    for offset, raw in enumerate(block):
        text = raw.strip()
        if not pending:
            if not COMMAND_START.match(text):
                continue
            first = start + offset + 1
        if text.endswith("\\"):
            pending += text[:-1] + " "
            continue
        out.append(Snippet(page, first, "shell", pending + text))
        pending = ""
    return out


SNIPPETS = [s for page in PAGES for s in _blocks(page)]


def _words(command: str) -> list[list[str]]:
    """The command's words, split at `&&` into commands; comments dropped."""
    words = shlex.split(command, comments=True)
    out: list[list[str]] = [[]]
    for word in words:
        if word == "&&":
            out.append([])
        else:
            out[-1].append(word)
    return [w for w in out if w]


def _run_cli(argv: list[str]) -> tuple[int, str]:
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
    return code, stdout.getvalue() + stderr.getvalue()


class _Parsed(Exception):
    """Raised by a patched `parse_args` once a script's arguments parsed."""


@contextlib.contextmanager
def _parse_only():
    """argparse stops a program right after its arguments parsed (any error exits as usual),
    whether it calls `parse_args` or `parse_known_args` (benchmarks/plan.py, which hands the
    rest to another script's parser)."""
    real_args = argparse.ArgumentParser.parse_args
    real_known = argparse.ArgumentParser.parse_known_args
    inside: list[object] = []  # parse_args calls parse_known_args itself

    def parse_args(self, args=None, namespace=None):  # noqa: ANN001, ANN202
        inside.append(self)
        try:
            real_args(self, args, namespace)
        finally:
            inside.pop()
        raise _Parsed

    def parse_known_args(self, args=None, namespace=None):  # noqa: ANN001, ANN202
        parsed = real_known(self, args, namespace)
        if not inside:
            raise _Parsed
        return parsed

    argparse.ArgumentParser.parse_args = parse_args
    argparse.ArgumentParser.parse_known_args = parse_known_args
    try:
        yield
    finally:
        argparse.ArgumentParser.parse_args = real_args
        argparse.ArgumentParser.parse_known_args = real_known


def _check_distrain(words: list[str]) -> None:
    command, args = words[0], words[1:]
    if command == "train":
        argv = ["train", *args] if "--check" in args else ["train", "--check", *args]
        code, said = _run_cli(argv)
        assert code == 0, said
        assert "distrain: config ok" in said, said
    elif command == "slurm":
        argv = ["slurm", *args] if "--dry-run" in args else ["slurm", "--dry-run", *args]
        code, said = _run_cli(argv)
        assert code == 0, said
        assert "#SBATCH" in said, said
    elif command == "plan":
        from distrain.layout.rules import validate
        from distrain.plan.command import base_config, parse

        validate(base_config(parse(args), absent=[]), None)
    elif command == "presets":
        code, said = _run_cli(["presets", *args])
        assert code == 0, said
    else:
        assert command in COMMANDS, f"distrain has no command {command!r}"
        with pytest.raises(SystemExit) if "--help" in args else contextlib.nullcontext():
            COMMANDS[command].parser().parse_args(args)


def _check_shell(command: str, monkeypatch: pytest.MonkeyPatch) -> None:
    for words in _words(command):
        joined = " ".join(words)
        if any(joined.startswith(prefix) for prefix in COVERED):
            continue
        tool = words[0]
        if tool in LAUNCHERS:
            inner = next(
                (i for i, w in enumerate(words) if w in ("distrain", "distrain.train")), None
            )
            assert inner is not None, f"{tool} runs no distrain command: {joined}"
            # `torchrun ... -m distrain.train ARGS` runs a worker: the same config options.
            rest = words[inner + 1 :]
            _check_distrain(rest if words[inner] == "distrain" else ["train", *rest])
        elif tool == "distrain":
            _check_distrain(words[1:])
        elif tool in ("python", "python3") and words[1:3] == ["-m", "distrain"]:
            _check_distrain(words[3:])
        elif tool in ("python", "python3") and words[1] == "-c":
            done = subprocess.run(
                [sys.executable, *words[1:]], capture_output=True, text=True, timeout=120
            )
            assert done.returncode == 0, done.stderr
        elif tool in ("python", "python3"):
            script = ROOT / words[1]
            assert script.is_file(), f"no script {words[1]}"
            monkeypatch.setattr(sys, "argv", [str(script), *words[2:]])
            monkeypatch.syspath_prepend(str(script.parent))
            with _parse_only(), pytest.raises(_Parsed):
                runpy.run_path(str(script), run_name="__main__")
        elif tool == "pip":
            _check_pip(words)
        else:
            assert tool in OTHER_TOOLS, f"unchecked command: {joined}"


def _check_pip(words: list[str]) -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    extras = set(pyproject["project"]["optional-dependencies"])
    (pin,) = [Requirement(d) for d in pyproject["project"]["dependencies"] if d.startswith("torch")]
    for word in words[2:]:
        if word.startswith("torch"):
            version = Requirement(word).specifier
            assert all(pin.specifier.contains(v.version) for v in version), f"{word} vs {pin}"
        found = re.fullmatch(r"\.\[([\w,]+)\]", word)
        if found:
            named = set(found.group(1).split(","))
            assert named <= extras, f"no extra {sorted(named - extras)} in pyproject.toml"


def _world_size(table: dict) -> int:
    """The ranks a config's [parallel] degrees take (each -1 or absent counted once)."""
    p = table.get("parallel", {})
    size = 1
    for degree in ("dp_replicate", "dp_shard", "tp", "pp", "cp"):
        size *= max(1, p.get(degree, 1))
    return size


def _check_toml(text: str, tmp_path: Path) -> None:
    table = tomllib.loads(text)
    if "project" in table:  # a plugin's pyproject.toml
        from distrain.models.registry import ENTRY_POINT_GROUP

        assert ENTRY_POINT_GROUP in table["project"]["entry-points"]
        return
    config = tmp_path / "snippet.toml"
    config.write_text(text)
    world = str(_world_size(table))
    code, said = _run_cli(["train", "--check", "--config", str(config), "--world-size", world])
    assert code == 0, said


def _check_python(text: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from distrain.launch.preflight import preflight
    from distrain.layout.rules import validate

    def check_only(cfg):  # noqa: ANN001, ANN202
        validate(cfg, 1, absent=[])
        preflight(cfg, absent=[])

    monkeypatch.setattr(distrain, "run_training", check_only)
    exec(compile(text, "<snippet>", "exec"), {})


@pytest.mark.parametrize("snippet", SNIPPETS, ids=lambda s: s.name)
def test_snippet_runs_as_written(snippet, tmp_path, monkeypatch):
    page = str(snippet.page.relative_to(ROOT))
    if page in RUN_IN_ORDER:
        assert (ROOT / RUN_IN_ORDER[page].split("::")[0]).is_file()
        return  # run, in order, there
    monkeypatch.chdir(ROOT)
    if snippet.kind == "toml":
        _check_toml(snippet.text, tmp_path)
    elif snippet.kind == "python":
        _check_python(snippet.text, monkeypatch)
    else:
        _check_shell(snippet.text, monkeypatch)


def test_the_harness_finds_the_pages_commands():
    """The extraction itself: the README's quickstart and test commands, a fenced TOML block
    and a continued command are found, and no admonition's prose is read as a command."""
    names = {s.name: s for s in SNIPPETS}
    readme = [s.text for s in SNIPPETS if s.page.name == "README.md" and s.page.parent == ROOT]
    assert "pip install torch==2.13.0 -e . && distrain train" in readme
    assert any(s.kind == "toml" for s in SNIPPETS)
    assert any("\\" not in s.text and "--rdzv-id" in s.text for s in SNIPPETS)
    assert not any(s.text.startswith("distrain's") for s in SNIPPETS)
    assert len(names) == len(SNIPPETS) > 40


@pytest.mark.parametrize("guide", ["hugging-face.md", "fine-tuning.md"])
def test_the_hf_extra_holds_what_the_hugging_face_guides_use(guide):
    """A library the Hugging Face guides call (`transformers.AutoModelForCausalLM...` to check
    an export, `peft.PeftModel...`, `from transformers import pipeline`) installs with the
    `[hf]` extra the guides install."""
    text = (ROOT / "docs" / "guides" / guide).read_text()
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    libraries = {Requirement(d).name for d in extras["dev"]}
    named = re.findall(r"`(\w+)\.", text) + re.findall(r"from (\w+) import", text)
    used = {name for name in named if name in libraries}
    assert "transformers" in used
    assert used <= {Requirement(d).name for d in extras["hf"]}
    assert '-e ".[hf]"' in text
