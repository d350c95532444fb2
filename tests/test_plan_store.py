"""The planner's fake builds kept on disk (distrain/plan/build_store.py): what makes a stored
build a hit or a miss, and plans that read every build back instead of building again."""

import dataclasses
import json

import pytest

from distrain.config.schema import Config
from distrain.plan import build_store, built_rows, search
from distrain.plan.build_store import BuildStore
from distrain.plan.memory import MemoryEstimate
from distrain.plan.search import plan
from distrain.plan.timing import Cluster


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

    def __call__(self, cfg: Config, world_size: int, *, rank: int = 0) -> MemoryEstimate:
        self.runs += 1
        return MemoryEstimate(world_size, rank, cfg.model.n_layers, *range(4, 17))


FIELDS = [f.name for f in dataclasses.fields(MemoryEstimate)]


def stored(**changes) -> str:
    """A stored MemoryEstimate's JSON text: every field 9, with `changes` (None drops one)."""
    fields = {name: 9 for name in FIELDS} | changes
    return json.dumps({k: v for k, v in fields.items() if v is not None})


def test_a_stored_build_is_read_back_and_anything_it_depends_on_misses(tmp_path, monkeypatch):
    store, estimate, cfg = BuildStore(tmp_path / "builds"), Counted(), small_config()
    first = store.build(estimate, MemoryEstimate, cfg, 4)
    assert estimate.runs == 1 and len(list(store.directory.iterdir())) == 1
    assert store.build(estimate, MemoryEstimate, cfg, 4) == first and estimate.runs == 1
    assert store.has(MemoryEstimate, cfg, 4)
    deeper = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, n_layers=9))
    misses = [(deeper, 4, 0), (cfg, 8, 0), (cfg, 4, 1)]
    for n, (other, world, rank) in enumerate(misses, 2):
        assert not store.has(MemoryEstimate, other, world, rank)
        found = store.build(estimate, MemoryEstimate, other, world, rank=rank)
        assert found == estimate(other, world, rank=rank)
        assert estimate.runs == 2 * n - 1  # one run stored, one to compare with
    # Other code (torch or distrain changed): every stored build is a miss.
    monkeypatch.setattr(build_store, "code_digest", lambda: "another version")
    assert not store.has(MemoryEstimate, cfg, 4)


def test_an_unreadable_file_is_built_again_and_a_failed_build_is_not_stored(tmp_path):
    store, estimate, cfg = BuildStore(tmp_path), Counted(), small_config()
    store.path(MemoryEstimate, cfg, 2).write_text("{half a fi")
    assert store.build(estimate, MemoryEstimate, cfg, 2) == estimate(cfg, 2)
    assert estimate.runs == 2
    assert store.build(estimate, MemoryEstimate, cfg, 2) == estimate(cfg, 2)
    assert estimate.runs == 3  # read back this time

    def fails(cfg: Config, world_size: int, *, rank: int = 0) -> MemoryEstimate:
        raise RuntimeError("no kernel")

    with pytest.raises(RuntimeError, match="no kernel"):
        store.build(fails, MemoryEstimate, cfg, 3)
    assert not store.has(MemoryEstimate, cfg, 3)
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
    ],
)
def test_a_planted_cache_file_is_a_miss_never_a_result(tmp_path, planted):
    """The cache is data someone else may have written: a symlink (to a file holding a valid
    build), a missing or extra field, a value that is not an integer, or an oversized file is
    built again, and the planted file replaced by the real build."""
    store, estimate, cfg = BuildStore(tmp_path / "builds"), Counted(), small_config()
    store.directory.mkdir()
    path = store.path(MemoryEstimate, cfg, 2)
    if planted == "symlink":
        elsewhere = tmp_path / "elsewhere.json"
        elsewhere.write_text(stored())
        path.symlink_to(elsewhere)
    else:
        path.write_text(planted)
    assert store.build(estimate, MemoryEstimate, cfg, 2) == estimate(cfg, 2)
    assert estimate.runs == 2
    assert not path.is_symlink()
    assert store.build(estimate, MemoryEstimate, cfg, 2) == estimate(cfg, 2)
    assert estimate.runs == 3  # the real build, read back


CLUSTER = Cluster(
    nodes=1,
    gpus_per_node=4,
    memory_bytes=9e5,
    peak_flops=1e12,
    efficiency=1.0,
    intra_bw=1e9,
    inter_bw=1e8,
)
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
    monkeypatch.setattr(search.Pool, "submit", no_build)  # no build for a worker to make
    again = [r.as_dict() for r in plan(small_config(), CLUSTER, store=store, **options)]
    assert again == first
