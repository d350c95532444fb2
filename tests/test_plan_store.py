"""The planner's fake builds kept on disk (distrain/plan/build_store.py): what makes a stored
build a hit or a miss, and plans that read every build back instead of building again."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest
from helpers import small_cluster

from distrain.config.schema import Config
from distrain.parallel.run_plan import RunPlan
from distrain.plan import build_store, built_rows, parameter_table, search
from distrain.plan.build_results import MemoryEstimate
from distrain.plan.build_store import BuildStore
from distrain.plan.memory_model import model_of
from distrain.plan.parameter_table import ParameterTable
from distrain.plan.planned import planned_run
from distrain.plan.search import plan


def small_config() -> Config:
    cfg = Config()
    cfg.run.device = "cpu"
    cfg.model.dim, cfg.model.n_layers, cfg.model.n_heads, cfg.model.ffn_dim = 32, 8, 2, 64
    cfg.training.seq_len, cfg.training.global_batch_size = 16, 8
    cfg.training.compile = False
    return cfg


class Counted:
    """A stand-in fake build that counts its runs and answers from the world size."""

    def __init__(self):
        self.runs = 0

    def __call__(self, run: RunPlan, *, rank: int = 0) -> MemoryEstimate:
        self.runs += 1
        return MemoryEstimate(run.dims.world_size, rank, run.config.model.n_layers, *range(4, 17))


FIELDS = [f.name for f in dataclasses.fields(MemoryEstimate)]


def planned(world_size: int, cfg: Config | None = None) -> RunPlan:
    """The run of `cfg` (small_config() at micro-batch 1) on `world_size` ranks."""
    if cfg is None:
        cfg = small_config()
        cfg.training.micro_batch_size = 1
    return planned_run(cfg, world_size)


def stored(**changes) -> str:
    """A stored MemoryEstimate's JSON text: every field 9, with `changes` (None drops one)."""
    fields = {name: 9 for name in FIELDS} | changes
    return json.dumps({k: v for k, v in fields.items() if v is not None})


def test_a_stored_build_is_read_back_and_anything_it_depends_on_misses(tmp_path, monkeypatch):
    store, estimate, run = BuildStore(tmp_path / "builds"), Counted(), planned(4)
    first = store.build(estimate, MemoryEstimate, run)
    assert estimate.runs == 1 and len(list(store.directory.iterdir())) == 1
    assert store.build(estimate, MemoryEstimate, run) == first and estimate.runs == 1
    assert store.has(MemoryEstimate, run)
    cfg = run.config
    deeper = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, n_layers=9))
    misses = [(planned(4, deeper), 0), (planned(8), 0), (run, 1)]
    for n, (other, rank) in enumerate(misses, 2):
        assert not store.has(MemoryEstimate, other, rank)
        found = store.build(estimate, MemoryEstimate, other, rank=rank)
        assert found == estimate(other, rank=rank)
        assert estimate.runs == 2 * n - 1  # one run stored, one to compare with
    # Other code (torch or distrain changed): every stored build is a miss.
    monkeypatch.setattr(build_store, "code_digest", lambda: "another version")
    assert not store.has(MemoryEstimate, run)


def test_an_unreadable_file_is_built_again_and_a_failed_build_is_not_stored(tmp_path):
    store, estimate, run = BuildStore(tmp_path), Counted(), planned(2)
    store.path(MemoryEstimate, run).write_text("{half a fi")
    assert store.build(estimate, MemoryEstimate, run) == estimate(run)
    assert estimate.runs == 2
    assert store.build(estimate, MemoryEstimate, run) == estimate(run)
    assert estimate.runs == 3  # read back this time

    def fails(run: RunPlan, *, rank: int = 0) -> MemoryEstimate:
        raise RuntimeError("no kernel")

    failing = planned(1)
    with pytest.raises(RuntimeError, match="no kernel"):
        store.build(fails, MemoryEstimate, failing)
    assert not store.has(MemoryEstimate, failing)
    assert not list(tmp_path.glob("*.partial"))


@pytest.mark.parametrize(
    "planted",
    [
        "symlink",
        stored(opt_step_peak=None),
        stored(extra=7),
        stored(params="1"),
        stored(params=1.5),
        stored() + " " * 5000,  # a whole build, padded past MAX_FILE_BYTES
        "[" * 3000,  # nested deeper than the JSON reader's recursion allows
    ],
)
def test_a_planted_cache_file_is_a_miss_never_a_result(tmp_path, planted):
    """The cache is data someone else may have written: a symlink (to a file holding a valid
    build), a missing or extra field, a value that is not an integer, an oversized file or one
    nested past the reader's recursion is built again, and the planted file replaced by the
    real build."""
    store, estimate, run = BuildStore(tmp_path / "builds"), Counted(), planned(2)
    store.directory.mkdir()
    path = store.path(MemoryEstimate, run)
    if planted == "symlink":
        elsewhere = tmp_path / "elsewhere.json"
        elsewhere.write_text(stored())
        path.symlink_to(elsewhere)
    else:
        path.write_text(planted)
    assert store.build(estimate, MemoryEstimate, run) == estimate(run)
    assert estimate.runs == 2
    assert not path.is_symlink()
    assert store.build(estimate, MemoryEstimate, run) == estimate(run)
    assert estimate.runs == 3  # the real build, read back


CLUSTER = small_cluster(4, 9e5)
FAST_SEARCH = dict(stages=(0,), checkpointing=("none",), max_micro_batch=1)


def no_build(*args, **kwargs):
    raise AssertionError("a fake build ran although every build is stored")


@pytest.mark.parametrize("exhaustive", [False, True])
def test_a_plan_asked_again_reads_every_build_and_answers_the_same(
    tmp_path, monkeypatch, exhaustive
):
    """The fast search (memory model, fastest layouts built) and --exhaustive (every layout
    and pp rank built at full depth): with the store, the same rows as without; asked again, the
    same rows with no fake build run, no job sent to a build worker."""
    store = BuildStore(tmp_path)
    options = dict(exhaustive=exhaustive, verify=2, workers=2, **FAST_SEARCH)
    without = [r.as_dict() for r in plan(small_config(), CLUSTER, **options)]
    first = [r.as_dict() for r in plan(small_config(), CLUSTER, store=store, **options)]
    assert first == without
    assert {r["memory_source"] for r in first} == (
        {"fake build"} if exhaustive else {"fake build", "model"}
    )
    assert {r["layout"]["pp"] for r in first} == {1, 2, 4}
    assert True in {r["fits"] for r in first} and False in {r["fits"] for r in first}
    monkeypatch.setattr(built_rows, "estimate_memory", no_build)
    monkeypatch.setattr(built_rows, "estimate_pipeline_memory", no_build)
    monkeypatch.setattr(search.Pool, "start_soon", no_build)  # no worker started
    monkeypatch.setattr(search.Pool, "submit_soon", no_build)  # nor a build sent to one
    monkeypatch.setattr(parameter_table, "_built", no_build)  # the tables are read back too
    monkeypatch.setattr(parameter_table, "_TABLES", {})
    again = [r.as_dict() for r in plan(small_config(), CLUSTER, store=store, **options)]
    assert again == first


class CountedTable:
    """parameter_table's meta build, counting its runs."""

    def __init__(self):
        self.runs, self.built = 0, parameter_table._built

    def __call__(self, model) -> ParameterTable:
        self.runs += 1
        return self.built(model)


def test_a_parameter_table_is_kept_and_read_back_whole(tmp_path, monkeypatch):
    """The meta build's table (every name of a tied tensor, tp dims, expert and decay flags) is
    kept once and read back equal, with no meta build; another model misses."""
    monkeypatch.setattr(parameter_table, "_TABLES", {})
    monkeypatch.setattr(parameter_table, "_built", counted := CountedTable())
    store, cfg = BuildStore(tmp_path / "builds"), small_config()
    cfg.model.tie_embeddings = True
    model = model_of(cfg.model)
    parameter_table.load(model, store)
    made = parameter_table.table(model)
    assert counted.runs == 1 and len(list(store.directory.iterdir())) == 1
    names = [p.name for p in made.parameters]
    assert "tok_emb.weight" in names and "output.weight" in names
    assert len(made.unique()) == len(made.parameters) - 1  # the tied head: one tensor
    assert {p.tp_dim for p in made.parameters} == {0, 1, None}
    assert {p.decayed for p in made.parameters} == {True, False}
    monkeypatch.setattr(parameter_table, "_TABLES", {})
    parameter_table.load(model, store)
    assert parameter_table.table(model) == made and counted.runs == 1
    cfg.model.n_layers = 9
    parameter_table.load(model_of(cfg.model), store)
    assert counted.runs == 2 and len(list(store.directory.iterdir())) == 2


def planted_table(entry: list | None = None, **extra) -> str:
    """A stored table's JSON: one 2-D parameter (or `entry`), with `extra` top-level keys."""
    entry = entry if entry is not None else ["w", [4, 8], 0, 1, False, True]
    return json.dumps({"parameters": [entry], **extra})


@pytest.mark.parametrize(
    "planted",
    [
        "symlink",
        planted_table(["w", [-1, 8], 0, 1, False, True]),  # a negative dim
        planted_table(["w", [4, 8.0], 0, 1, False, True]),  # a dim that is not an integer
        planted_table(["w", [4, 8], 0, 2, False, True]),  # a tp dim outside the shape
        planted_table(["w", [4, 8], 0, True, False, True]),  # a tp dim that is a boolean
        planted_table(["w", [4, 8], 0, 1, 1, True]),  # a flag that is not a boolean
        planted_table(["w", [1] * 9, 0, 1, False, True]),  # more dims than a tensor has
        planted_table(["", [4, 8], 0, 1, False, True]),  # no name
        planted_table(["w", [4, 8], 0, 1, False]),  # a field missing
        planted_table(code="os.system"),  # another key
        planted_table() + " " * parameter_table.MAX_STORED_BYTES,  # oversized
        "[" * 100_000,  # nested past the reader's recursion
    ],
    ids=[
        "symlink", "negative-dim", "float-dim", "tp-dim-outside", "tp-dim-bool", "int-flag",
        "nine-dims", "no-name", "field-missing", "other-key", "oversized", "nested",
    ],
)  # fmt: skip
def test_a_planted_parameter_table_is_a_miss_never_a_result(tmp_path, monkeypatch, planted):
    """A table in the cache is data: a symlink to a valid one, any entry of the wrong kind or
    out of bounds, another key, an oversized or too deeply nested file is built again and
    replaced by the real table."""
    monkeypatch.setattr(parameter_table, "_TABLES", {})
    monkeypatch.setattr(parameter_table, "_built", counted := CountedTable())
    store, model = BuildStore(tmp_path / "builds"), model_of(small_config().model)
    parameter_table.load(model, store)
    real = parameter_table.table(model)
    (path,) = store.directory.iterdir()
    path.unlink()
    if planted == "symlink":
        elsewhere = tmp_path / "elsewhere.json"
        elsewhere.write_text(json.dumps(real.to_stored()))
        path.symlink_to(elsewhere)
    else:
        path.write_text(planted)
    monkeypatch.setattr(parameter_table, "_TABLES", {})
    parameter_table.load(model, store)
    assert counted.runs == 2 and parameter_table.table(model) == real
    assert not path.is_symlink()
    assert ParameterTable.from_stored(json.loads(path.read_text())) == real


WARM_IMPORTS = """
import sys
from distrain.plan.command import plan_command

plan_command(sys.argv[1:])
heavy = ("torch.distributed.tensor", "torch.distributed.fsdp", "torch._dynamo")
print(*[m for m in heavy if m in sys.modules], file=sys.stderr)
"""


def test_a_plan_that_reads_every_build_back_imports_none_of_the_training_stack(tmp_path):
    """Asked again, a plan reads its builds and parameter tables from the store, and never
    imports what only builds need (DTensor, FSDP2, dynamo: most of a warm plan's time); asked
    first, it does (so the check can fail)."""
    argv = ["--preset", "tiny", "--nodes", "1", "--gpus-per-node", "2", "--seq-len", "32",
            "--global-batch", "4", "--gpu-memory", "12MB", "--zero", "0,3", "--checkpointing",
            "none", "--peak", "100G", "--top", "3", "--workers", "1"]  # fmt: skip
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    command = [sys.executable, "-c", WARM_IMPORTS, *argv]
    cold, warm = (
        subprocess.run(command, env=env, capture_output=True, text=True, check=True)
        for _ in range(2)
    )
    heavy = ["torch.distributed.tensor", "torch.distributed.fsdp", "torch._dynamo"]
    assert cold.stderr.split() == heavy
    assert warm.stderr.split() == []
    assert warm.stdout == cold.stdout
