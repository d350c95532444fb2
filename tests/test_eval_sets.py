"""Named validation sets (data.eval_sets): each evaluated at every validation pass beside the
held-out split, with its loss and perplexity in the metrics row; the same loss on one process
and on parallel layouts (pipeline, tensor parallel), as the held-out split's; bad entries
refused in one line before any worker starts."""

from __future__ import annotations

import math
import sysconfig
from pathlib import Path

import pytest
from batch import Run, pool_name
from helpers import losses, train_in_process

from distrain.config.io import load_config, write_toml
from distrain.errors import ConfigError
from distrain.launch.preflight import preflight
from distrain.observe.metrics import read_metrics

STDLIB = Path(sysconfig.get_paths()["stdlib"])
EVAL_SETS = f"textwrap={STDLIB / 'textwrap.py'},argparse={STDLIB / 'argparse.py'}"
# The validation passes read the same sequences of each set on every layout: one global batch
# of 8 (see data/loader.py val_batches).
FIELDS = {
    "training__steps": 4,
    "training__global_batch_size": 8,
    "training__micro_batch_size": 2,
    "training__seq_len": 64,
    "training__eval_interval_steps": 2,
    "checkpoint__interval_steps": 0,
    "checkpoint__at_end": False,
    "data__eval_sets": EVAL_SETS,
}
LAYOUTS = {"pp2_1f1b": {"parallel__pp": 2}, "tp2_sp": {"parallel__tp": 2}}
KEYS = ("val_loss", "val/textwrap/loss", "val/argparse/loss")
REL_TOL = 1e-5  # as tests/test_parity.py's: summation order only


def batched_runs(names: set[str]) -> dict[str, Run]:
    runs = {
        f"test_eval_sets_match_single_process[{name}]": Run(2, {**FIELDS, **fields})
        for name, fields in LAYOUTS.items()
    }
    return {name: run for name, run in runs.items() if name in names}


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> list[dict]:
    return train_in_process(tmp_path_factory.mktemp("single") / "run", **FIELDS)


def _val_rows(rows: list[dict]) -> dict[int, dict]:
    return {r["step"]: r for r in rows if "val_loss" in r}


def test_each_set_has_loss_perplexity_and_the_pass_its_time(single):
    rows = _val_rows(single)
    assert sorted(rows) == [2, 4]
    for row in rows.values():
        for name in ("textwrap", "argparse"):
            loss = row[f"val/{name}/loss"]
            assert 0 < loss < 10 and row[f"val/{name}/ppl"] == pytest.approx(math.exp(loss))
        assert row["val_ppl"] == pytest.approx(math.exp(row["val_loss"]))
        assert row["eval_s"] > 0
        # The tokens each pass scored: whole global batches of 8 sequences of 64 tokens.
        for key in ("val_tokens", "val/textwrap/tokens", "val/argparse/tokens"):
            assert row[key] > 0 and row[key] % (8 * 64) == 0
    # Different text, different loss: each set is its own (not the held-out split again).
    assert len({round(rows[4][k], 6) for k in KEYS}) == 3
    assert rows[4]["val/textwrap/loss"] < rows[2]["val/textwrap/loss"]  # it learns


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_eval_sets_match_single_process(layout, single, batch_pool, request):
    run_dir = batch_pool.trained(pool_name(__name__, request.node.name))
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert losses(rows) == pytest.approx(losses(single), rel=REL_TOL)
    got, want = _val_rows(rows), _val_rows(single)
    assert got.keys() == want.keys() == {2, 4}
    for step in want:
        for key in KEYS:
            assert got[step][key] == pytest.approx(want[step][key], rel=REL_TOL), (step, key)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("a b=/x", "data.eval_sets[0].name = 'a b': give each eval set a name of letters"),
        ("a=/x,a=/y", "data.eval_sets[1].name = 'a' is used twice; names must be unique"),
        ("a=", "data.eval_sets[0] (a) has no path; set the file or folder to read"),
        ("/x", "data.eval_sets: expected NAME=PATH, got '/x'"),
    ],
)
def test_bad_eval_sets_are_one_line(value, expected):
    with pytest.raises(ConfigError) as info:
        load_config(None, [("data.eval_sets", value)])
    assert str(info.value).startswith(expected) and "\n" not in str(info.value)


def test_eval_sets_from_toml_and_a_missing_path(tmp_path):
    config = tmp_path / "c.toml"
    config.write_text(
        '[[data.eval_sets]]\nname = "code"\npath = "/nonexistent/code"\nformat = "text"\n'
    )
    cfg = load_config(str(config), [("run.dir", str(tmp_path / "run"))])
    assert [(e.name, e.path, e.format) for e in cfg.data.eval_sets] == [
        ("code", "/nonexistent/code", "text")
    ]
    write_toml(cfg, tmp_path / "again.toml")  # config.toml of a run reads back the same
    assert load_config(str(tmp_path / "again.toml")).data.eval_sets == cfg.data.eval_sets
    with pytest.raises(ConfigError, match="data.eval_sets 'code': no such file or folder"):
        preflight(cfg)
    config.write_text('[[data.eval_sets]]\nname = "code"\npaht = "/x"\n')
    with pytest.raises(ConfigError, match=r"data.eval_sets\[0\]: unknown key 'paht'"):
        load_config(str(config))
