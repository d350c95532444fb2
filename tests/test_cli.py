"""The `distrain` command explains itself: the command list and --version, a help text and a
shown default for every option, help within 100 columns and without torch, one-line usage
errors (exit 2), did-you-mean for config fields, the grouped field reference, the commented
default config, the Slurm script's options, `train --check` and `--resume-from STEP`."""

from __future__ import annotations

import dataclasses
import gc
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from distrain.checkpoint.manifest import MANIFEST, rewind, step_name
from distrain.checkpoint.storage import Storage
from distrain.cli import COMMANDS, EXPORT_DTYPES, EXPORT_SHARD_MB, main, program
from distrain.config.io import config_changes, default_config_toml, help_text, load_config
from distrain.config.schema import Config
from distrain.errors import CheckpointError, ConfigError
from distrain.launch.slurm import SlurmJob, sbatch_script
from tests.helpers import cli_in_process, train_in_process

# In the compat suite (.ci/run: also on the oldest and newest torch): the CLI's refusals.
pytestmark = pytest.mark.compat


def _lines(text: str) -> list[str]:
    return text.strip().splitlines()


def test_top_level_help_lists_every_command_and_the_version(capsys):
    result = cli_in_process(capsys, "--help")
    assert result.returncode == 0
    for name, command in COMMANDS.items():
        assert f"  {name}" in result.stdout and command.summary in result.stdout
    result = cli_in_process(capsys, "--version")
    assert result.stdout.strip().startswith("distrain 0.")


@pytest.mark.parametrize(("name", "frozen"), [("plan", True), ("presets", False), ("train", False)])
def test_only_a_quick_exit_command_leaves_its_objects_to_the_exit(monkeypatch, name, frozen):
    """`distrain plan` freezes what it made before the interpreter's last collection; a command
    that may hold files open (train) is collected as usual; the exit code is main's."""
    ran, freezes = [], []
    command = dataclasses.replace(COMMANDS[name], run=ran.append)
    monkeypatch.setitem(COMMANDS, name, command)
    monkeypatch.setattr(gc, "freeze", lambda: freezes.append(True))
    monkeypatch.setattr(sys, "argv", ["distrain", name, "--x"])
    with pytest.raises(SystemExit) as exit_:
        program()
    assert exit_.value.code == 0 and ran == [["--x"]]
    assert freezes == ([True] if frozen else [])


@pytest.mark.parametrize("name", list(COMMANDS))
def test_every_option_has_help_and_the_help_fits_100_columns(name):
    parser = COMMANDS[name].parser()
    for action in parser._actions:
        assert action.help, (name, action.option_strings or action.dest)
    text = parser.format_help()
    assert max(len(line) for line in text.splitlines()) <= 100, name
    for action in parser._actions:
        default = action.default
        if (
            action.option_strings
            and default not in (None, False, [], "==SUPPRESS==")
            and (not isinstance(default, bool))
        ):
            # The default is shown: by the formatter, or in the help's own words.
            assert "default" in parser._get_formatter()._get_help_string(action), action.dest


def test_help_of_every_command_answers_without_torch():
    code = (
        "import sys\nfrom distrain.cli import COMMANDS, main\n"
        "for name in [None, *COMMANDS]:\n"
        "    try:\n"
        "        main(['--help'] if name is None else [name, '--help'])\n"
        "    except SystemExit:\n"
        "        pass\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["train", "--nproc", "abc"], "argument --nproc: invalid int value: 'abc'"),
        (["generate", "--run-dir", "r", "--temperature", "hot"], "invalid float value: 'hot'"),
        (["export", "r"], "the following arguments are required: --out"),
        (["slurm", "--gpus-per-node", "x"], "invalid int value: 'x'"),
        (["plan", "--nodes", "two"], "invalid int value: 'two'"),
        (["train", "--help-config", "trainig"], "did you mean 'training'?"),
        (["train", "steps=3"], "unrecognized argument 'steps=3'"),
        (["--bogus"], "unknown option '--bogus'"),
    ],
)
def test_usage_errors_are_one_line_and_exit_2(args, expected, capsys):
    result = cli_in_process(capsys, *args)
    assert result.returncode == 2, result.stderr
    (line,) = _lines(result.stderr)
    assert line.startswith("distrain: error: ") and expected in line


def test_a_field_typo_names_the_field_meant(capsys):
    result = cli_in_process(capsys, "train", "--training.stpes", "3")
    assert result.returncode == 1
    assert _lines(result.stderr) == [
        "distrain: error: unknown config field 'training.stpes'; did you mean 'training.steps'? "
        "(`distrain train --help-config training` lists its section)"
    ]
    with pytest.raises(ConfigError, match="did you mean 'model.moe.top_k'"):
        load_config(None, [("model.moe.topk", "2")])


def test_train_help_is_short_and_the_reference_is_grouped(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    short = capsys.readouterr().out
    assert "--help-config" in short and not re.search(r"debug\.\w", short)
    assert len(_lines(short)) < 70
    with pytest.raises(SystemExit):
        main(["train", "--help-config"])
    reference = capsys.readouterr().out
    assert "[training]" in reference and "[model.moe]" in reference
    assert not re.search(r"debug\.\w", reference)
    assert max(len(line) for line in reference.splitlines()) <= 100
    with pytest.raises(SystemExit):
        main(["train", "--help-config", "debug"])
    debug = capsys.readouterr().out
    assert "[debug]" in debug and "[training]" not in debug
    # One name per choice: `Literal["aux", "bias", "none"] | None` is not "... | none | none".
    assert "model.moe.balance (aux | bias | none, default None)" in help_text()


def test_init_config_writes_the_defaults_with_their_help(tmp_path, capsys):
    path = tmp_path / "default.toml"
    assert cli_in_process(capsys, "init-config", str(path)).returncode == 0
    text = path.read_text()
    assert text == default_config_toml()
    assert "# Optimizer steps to train for." in text and "\nsteps = 600\n" in text
    assert "# vocab_size =" in text  # None: commented out (TOML has no null)
    assert max(len(line) for line in text.splitlines()) <= 100
    assert load_config(path) == Config()
    again = cli_in_process(capsys, "init-config", str(path))
    assert again.returncode == 1 and "exists; choose another FILE or add --force" in again.stderr
    assert cli_in_process(capsys, "init-config", str(path), "--force").returncode == 0


def test_config_changes_name_each_changed_field():
    old = tomllib.loads("[training]\nsteps = 100\n[optim]\nlr = 0.001\n")
    new = load_config(None, [("training.steps", "200"), ("optim.lr", "0.001")])
    changes = config_changes(old, new.to_dict())
    assert "training.steps: 100 -> 200" in changes
    assert not any(c.startswith("optim.lr") for c in changes)


def test_export_choices_are_the_exporters():
    from distrain.interop.export import DEFAULT_SHARD_MB, DTYPES

    assert EXPORT_DTYPES == tuple(DTYPES) and EXPORT_SHARD_MB == DEFAULT_SHARD_MB


# --- distrain slurm ------------------------------------------------------------------------


def _job(**changes: object) -> SlurmJob:
    fields = dict(min_nodes=2, max_nodes=2, grace_s=90, run_dir=Path("/runs/x"), train_argv=[])
    fields.update(changes)
    return SlurmJob(**fields)


def test_slurm_options_and_pass_through_lines_become_directives():
    script = sbatch_script(
        _job(
            qos="high",
            constraint="h100&ib",
            cpus_per_task=32,
            exclusive=True,
            sbatch_lines=("--mail-type=END,FAIL", "--mem 0", "--job-name=llama"),
        )
    )
    lines = script.splitlines()
    for line in (
        "#SBATCH --qos=high",
        "#SBATCH '--constraint=h100&ib'",
        "#SBATCH --cpus-per-task=32",
        "#SBATCH --exclusive",
        "#SBATCH --mail-type=END,FAIL",
        "#SBATCH --mem 0",
        "#SBATCH --job-name=llama",
    ):
        assert line in lines, line
    assert "#SBATCH --job-name=distrain" not in lines  # replaced, not doubled
    # The job's own python3 from PATH, not this machine's interpreter path.
    assert "    python3 -m distrain train --run-dir /runs/x \\" in lines
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"sbatch_lines": ("--nodes=4",)}, r"sets --nodes; use --nodes"),
        ({"sbatch_lines": ("-p gpu",)}, r"sets -p; use --partition"),
        ({"sbatch_lines": ("--mem=1G", "--mem=2G")}, r"--mem given more than once"),
        ({"sbatch_lines": ("--mem=1G\ntouch x",)}, r"control characters"),
        ({"sbatch_lines": ("mem=1G",)}, r"expected an sbatch option"),
        ({"qos": "a\nb"}, r"--qos: control characters"),
        ({"cpus_per_task": 0}, r"--cpus-per-task must be >= 1"),
        ({"train_argv": ["--resume-from", "400"]}, r"--resume-from STEP: not in a job"),
    ],
)
def test_bad_slurm_options_are_one_line_errors(changes, message):
    with pytest.raises(ConfigError, match=message) as refused:
        sbatch_script(_job(**changes))
    assert "\n" not in str(refused.value)


def test_a_hostile_sbatch_line_stays_one_directive(tmp_path):
    marker = tmp_path / "MARKER"
    script = sbatch_script(_job(sbatch_lines=(f"--comment='$(touch {marker})'",)))
    assert f"#SBATCH '--comment=$(touch {marker})'" in script.splitlines()
    assert len(script.splitlines()) == len(sbatch_script(_job()).splitlines()) + 1


def test_dry_run_gives_the_run_dir_once(tmp_path, capsys):
    run = tmp_path / "run"
    result = cli_in_process(
        capsys, "slurm", "--dry-run", "--python", "/opt/py/bin/python", "--",
        "--run-dir", str(run), "--run.dir", str(run), "--training.steps", "3",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("--run-dir") == 1 and "--run.dir" not in result.stdout
    assert f"/opt/py/bin/python -m distrain train --training.steps 3 --run-dir {run}" in (
        result.stdout
    )


# --- train --check and --resume-from --------------------------------------------------------


def test_check_prints_the_layout_and_trains_nothing(tmp_path, capsys):
    run = tmp_path / "run"
    result = cli_in_process(
        capsys, "train", "--check", "--world-size", "4", "--run-dir", str(run),
        "--parallel.zero_stage", "3", "--training.micro_batch_size", "4",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "config ok for 4 rank(s)" in result.stdout
    assert "dp_shard 4" in result.stdout and "ZeRO stage 3" in result.stdout
    assert not run.exists()
    bad = cli_in_process(capsys, "train", "--check", "--world-size", "3")
    assert bad.returncode == 1 and "data-parallel size (3" in bad.stderr
    alone = cli_in_process(capsys, "train", "--world-size", "3")
    assert alone.returncode == 1 and "--world-size: only with --check" in alone.stderr


def test_a_preset_alone_picks_its_family(tmp_path, capsys):
    """--model.preset llama-tiny trains the llama family without --model.family (the check and
    a run); an explicit family that does not hold the preset is one line with the fix."""
    ok = cli_in_process(capsys, "train", "--check", "--model.preset", "llama-tiny")
    assert ok.returncode == 0, ok.stderr
    bad = cli_in_process(
        capsys, "train", "--check", "--model.preset", "llama-tiny", "--model.family", "gpt"
    )
    assert bad.returncode == 1
    assert bad.stderr.strip().endswith(
        "'llama-tiny' is a preset of model.family 'llama', not of model.family = 'gpt'; remove "
        "model.family (the preset names its family) or set model.family = 'llama'"
    )
    assert len(bad.stderr.strip().splitlines()) == 1
    run = tmp_path / "run"
    rows = train_in_process(run, model__preset="llama-tiny", training__steps=2)
    assert [r["step"] for r in rows if "loss" in r][-1] == 2
    assert "model llama-tiny: " in (run / "logs" / "rank0.log").read_text()


def _commit(root: Path, step: int, kind: str) -> None:
    folder = root / step_name(step)
    folder.mkdir(parents=True)
    manifest = {"run_id": "r", "kind": kind, "permanent": kind == "permanent", "files": {}}
    (folder / MANIFEST).write_text(json.dumps(manifest))


def test_rewind_deletes_the_newer_checkpoints_only(tmp_path):
    for step, kind in ((2, "temporary"), (4, "temporary"), (6, "preempt")):
        _commit(tmp_path, step, kind)
    storage = Storage(str(tmp_path))
    with pytest.raises(CheckpointError, match=r"no complete checkpoint of step 3 .*steps there"):
        rewind(storage, 3)
    assert rewind(storage, 2) == [step_name(4), step_name(6)]
    assert sorted(p.name for p in tmp_path.iterdir()) == [step_name(2)]
    _commit(tmp_path, 8, "permanent")
    with pytest.raises(CheckpointError, match=r"step-00000008 are permanent"):
        rewind(storage, 2)
    assert (tmp_path / step_name(8)).is_dir()


def test_launcher_options_never_reach_the_workers():
    from distrain.config.args import strip_launch_options

    argv = ["--nproc", "2", "--world-size=8", "--resume-from", "runs/a/checkpoints/step-00000004"]
    assert strip_launch_options([*argv, "--resume-from=12", "--training.steps", "3"]) == [
        "--checkpoint.resume_from",
        "runs/a/checkpoints/step-00000004",
        "--training.steps",
        "3",
    ]
