"""Checkpoint protocol in one process: commit by manifest, verification and fallback, retention,
async saves, safe loading, and a full disk. Multi-rank saves are covered in test_training.py."""

import builtins
import contextlib
import errno
import hashlib
import io
import json
import logging
import re
import shutil
import subprocess

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import process_group, train_in_process

from distrain.checkpoint import checkpointer, load, manifest
from distrain.checkpoint.checkpointer import Checkpointer, SaveRecord
from distrain.checkpoint.manifest import committed
from distrain.checkpoint.storage import Storage
from distrain.config.schema import OptimConfig
from distrain.errors import CheckpointError
from distrain.observe.diagnose import diagnose
from distrain.observe.metrics import read_metrics
from distrain.optim.builder import build_optimizer
from distrain.optim.state_dict import optimizer_state_dict

# In the compat suite (.ci/run: also on the oldest and newest torch): checkpoint save and resume.
pytestmark = pytest.mark.compat

# Not under "distrain": setup_logging turns that logger's propagation off, hiding it from caplog.
LOG = logging.getLogger("distrain_test.checkpoint")


def _state(value: float) -> dict:
    return {"model": {"w": torch.full((64, 64), value)}, "step": torch.tensor(0)}


def _checkpointer(tmp_path, *, keep: int = 2, async_mode: str = "off") -> Checkpointer:
    return Checkpointer(
        Storage(str(tmp_path)),
        run_id="test",
        layout="test",
        async_mode=async_mode,
        keep_temporary=keep,
        logger=LOG,
    )


def _restored(ckpt: Checkpointer) -> tuple[int | None, float]:
    target = _state(0.0)
    step = ckpt.restore_latest(target)
    return step, float(target["model"]["w"][0, 0])


def test_round_trip_and_manifest(tmp_path):
    ckpt = _checkpointer(tmp_path)
    ckpt.save(3, _state(1.5), permanent=False)
    assert _restored(ckpt) == (3, 1.5)
    manifest = json.loads((tmp_path / "step-00000003" / "MANIFEST.json").read_text())
    assert manifest["step"] == 3 and manifest["kind"] == "temporary"
    assert manifest["world_size"] == 1 and manifest["layout"] == "test"
    assert {"distrain_version", "torch_version"} <= manifest.keys()
    assert ".metadata" in manifest["files"]
    assert all(len(f["sha256"]) == 64 and f["size"] > 0 for f in manifest["files"].values())


def test_a_source_tree_never_installed_still_commits_with_its_version(tmp_path, monkeypatch):
    """Run from a checkout on PYTHONPATH, with no distribution metadata (as on a machine where
    distrain was copied, not installed), a save commits and records pyproject.toml's version."""
    import importlib.metadata
    import tomllib
    from pathlib import Path

    real = importlib.metadata.Distribution.from_name

    def uninstalled(name):
        if name == "distrain":
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata.Distribution, "from_name", uninstalled)
    ckpt = _checkpointer(tmp_path)
    ckpt.save(3, _state(1.5), permanent=False)
    assert _restored(ckpt) == (3, 1.5)
    manifest = json.loads((tmp_path / "step-00000003" / "MANIFEST.json").read_text())
    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    declared = tomllib.loads(pyproject.read_text())["project"]["version"]
    assert manifest["distrain_version"] == declared
    import distrain
    from distrain.version import version

    assert version() == declared == distrain.__version__


def test_save_torn_before_manifest_is_ignored(tmp_path, monkeypatch):
    ckpt = _checkpointer(tmp_path)
    ckpt.save(1, _state(1.0), permanent=False)

    def crash(*_args, **_kwargs):
        raise KeyboardInterrupt("killed before the manifest")

    monkeypatch.setattr(checkpointer, "write_manifest", crash)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save(2, _state(2.0), permanent=False)
    assert (tmp_path / "step-00000002" / ".metadata").exists()  # data there, never committed
    assert [e.step for e in committed(ckpt.storage)] == [1]
    assert _restored(_checkpointer(tmp_path)) == (1, 1.0)


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda f: f.write_bytes(f.read_bytes()[:-10]), "bytes, manifest says"),  # truncated
        (
            lambda f: f.write_bytes(bytes([f.read_bytes()[0] ^ 1]) + f.read_bytes()[1:]),
            "fails its SHA-256 checksum",
        ),  # one flipped bit, same size
        (lambda f: f.unlink(), "is missing"),
    ],
    ids=["truncated", "bitflip", "missing"],
)
def test_damaged_newest_falls_back_to_previous(tmp_path, caplog, damage, reason):
    ckpt = _checkpointer(tmp_path)
    ckpt.save(1, _state(1.0), permanent=False)
    ckpt.save(2, _state(2.0), permanent=False)
    damage(next((tmp_path / "step-00000002").glob("*.distcp")))
    with caplog.at_level(logging.WARNING, logger=LOG.name):
        assert _restored(_checkpointer(tmp_path)) == (1, 1.0)
    assert "step-00000002 is damaged" in caplog.text and reason in caplog.text


def test_nothing_intact_restores_nothing(tmp_path):
    ckpt = _checkpointer(tmp_path)
    ckpt.save(1, _state(1.0), permanent=False)
    next((tmp_path / "step-00000001").glob("*.distcp")).write_bytes(b"junk")
    assert _restored(_checkpointer(tmp_path))[0] is None


def test_checkpoint_without_manifest_is_reported(tmp_path, caplog):
    ckpt = _checkpointer(tmp_path)
    ckpt.save(1, _state(1.0), permanent=False)
    ckpt.save(2, _state(2.0), permanent=False)
    (tmp_path / "step-00000002" / "MANIFEST.json").unlink()
    with caplog.at_level(logging.WARNING, logger=LOG.name):
        assert _restored(_checkpointer(tmp_path)) == (1, 1.0)
    assert (
        f"checkpoint {tmp_path / 'step-00000002'} is incomplete (no MANIFEST.json: its save "
        "never finished, or the manifest was deleted); ignoring it"
    ) in caplog.text


def test_save_hashes_while_writing_and_reads_nothing_back(tmp_path, monkeypatch):
    ckpt = _checkpointer(tmp_path / "ckpt")
    reads: list[str] = []
    real_open = io.open

    def counting_open(file, mode="r", *args, **kwargs):
        if str(tmp_path) in str(file) and not any(c in mode for c in "wax+"):
            reads.append(str(file))
        return real_open(file, mode, *args, **kwargs)

    def no_second_pass(*_args, **_kwargs):
        raise AssertionError("a save must not stat or re-read what it wrote")

    with monkeypatch.context() as patch:
        patch.setattr(io, "open", counting_open)
        patch.setattr(builtins, "open", counting_open)
        patch.setattr(Storage, "sha256", no_second_pass)
        patch.setattr(Storage, "size", no_second_pass)
        ckpt.save(1, _state(1.0), permanent=False)
        ckpt.save(2, {"model": {"w": torch.randn(300, 70)}}, permanent=True)
    # Rank 0 reads the small rank records to write a manifest, and retention reads manifests;
    # the data files written (.distcp shards, .metadata) are never opened for reading.
    assert {r.rsplit("/", 1)[1] for r in reads} == {"rank0.json", "MANIFEST.json"}
    for step in (1, 2):
        folder = tmp_path / "ckpt" / f"step-{step:08d}"
        files = json.loads((folder / "MANIFEST.json").read_text())["files"]
        on_disk = {p.name for p in folder.iterdir()} - {"MANIFEST.json", "rank0.json"}
        assert set(files) == on_disk
        for name, info in files.items():
            data = (folder / name).read_bytes()
            assert info == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def test_retention_keeps_newest_temporary_and_every_permanent(tmp_path):
    ckpt = _checkpointer(tmp_path, keep=2)
    for step in range(1, 8):
        ckpt.save(step, _state(float(step)), permanent=step in (2, 5))
    kept = [(e.step, e.permanent) for e in committed(ckpt.storage)]
    assert kept == [(2, True), (5, True), (6, False), (7, False)]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step-00000002",
        "step-00000005",
        "step-00000006",
        "step-00000007",
    ]


def _failing_writer(ckpt: Checkpointer, monkeypatch, error: BaseException) -> None:
    """Make every later save's DCP write raise `error`, as its storage would."""
    real_writer = ckpt.storage.dcp_writer

    def writer_that_fails(path):
        writer = real_writer(path)

        def fail(*_args, **_kwargs):
            raise error

        writer.write_data = fail
        return writer

    monkeypatch.setattr(ckpt.storage, "dcp_writer", writer_that_fails)


def _disk_full_message(step: int, where) -> str:
    return (
        rf"checkpoint step-{step:08d} not saved: disk full on {re.escape(str(where))} "
        r"\([\d.]+ MB free when the save failed, [\d.]+ MB as it began; [\d.]+ MB needed\)"
    )


def test_failed_saves_are_reported_removed_and_stop_the_run(tmp_path, monkeypatch):
    ckpt = _checkpointer(tmp_path, keep=1)
    failures: list[tuple[int, str]] = []
    ckpt.on_failure = lambda step, message: failures.append((step, message))
    ckpt.save(1, _state(1.0), permanent=False)
    _failing_writer(ckpt, monkeypatch, OSError(errno.ENOSPC, "No space left on device"))
    ckpt.save(2, _state(2.0), permanent=False)
    ckpt.save(3, _state(3.0), permanent=False)
    assert [s for s, _ in failures] == [2, 3]
    assert re.fullmatch(_disk_full_message(2, tmp_path), failures[0][1])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000001"]  # torn dirs removed
    assert ckpt.newest_committed == 1
    with pytest.raises(CheckpointError) as stopped:
        ckpt.save(4, _state(4.0), permanent=False)  # the third failure in a row
    assert re.match(_disk_full_message(4, tmp_path), str(stopped.value))
    assert "3 saves in a row failed (checkpoint.max_failed_saves = 3)" in str(stopped.value)
    assert str(stopped.value).endswith("newest committed checkpoint: step-00000001")
    assert _restored(_checkpointer(tmp_path)) == (1, 1.0)


def test_a_success_resets_the_failure_count_and_other_causes_are_named(tmp_path, monkeypatch):
    ckpt = _checkpointer(tmp_path)
    ckpt.max_failed_saves = 2
    failures: list[str] = []
    ckpt.on_failure = lambda step, message: failures.append(message)
    with monkeypatch.context() as patch:
        _failing_writer(ckpt, patch, RuntimeError("bad tensor\nsecond line"))
        ckpt.save(1, _state(1.0), permanent=False)
    ckpt.save(2, _state(2.0), permanent=False)
    with monkeypatch.context() as patch:
        _failing_writer(ckpt, patch, RuntimeError("bad tensor"))
        ckpt.save(3, _state(3.0), permanent=False)  # 1 in a row again: no stop
    assert failures[0] == (
        f"checkpoint step-00000001 not saved: writing to {tmp_path} failed on rank 0 "
        "(RuntimeError: bad tensor)"
    )
    assert len(failures) == 2 and ckpt.newest_committed == 2


def test_a_failed_background_save_is_reported_and_the_next_one_commits(tmp_path, monkeypatch):
    ckpt = _checkpointer(tmp_path, async_mode="thread")
    failures: list[str] = []
    saved: list[SaveRecord] = []
    ckpt.on_failure = lambda step, message: failures.append(message)
    ckpt.on_saved = saved.append
    ckpt.save(1, _state(1.0), permanent=False)
    ckpt.wait()
    with monkeypatch.context() as patch:
        _failing_writer(ckpt, patch, OSError(errno.ENOSPC, "No space left on device"))
        ckpt.save(2, _state(2.0), permanent=False)  # returns once staged: no error here
        ckpt.wait()
    assert len(failures) == 1 and re.fullmatch(_disk_full_message(2, tmp_path), failures[0])
    assert [p.name for p in tmp_path.iterdir()] == ["step-00000001"]
    assert ckpt.newest_committed == 1 and ckpt.failed_in_a_row == 1
    ckpt.save(3, _state(3.0), permanent=False)  # the next interval tries again
    ckpt.wait()
    ckpt.close(timeout_s=0)
    assert ckpt.newest_committed == 3 and ckpt.failed_in_a_row == 0
    assert [(r.step, r.error is None) for r in saved] == [(1, True), (2, False), (3, True)]
    assert saved[0].bytes == 64 * 64 * 4 + 8 and saved[0].write_s > 0 and saved[0].stall_s > 0
    assert _restored(_checkpointer(tmp_path)) == (3, 3.0)


@contextlib.contextmanager
def _tmpfs(mount_point, size: str):
    """A real filesystem of `size` (tmpfs) at `mount_point`, unmounted afterwards."""
    mount_point.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount_point)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root/CAP_SYS_ADMIN): {done.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", str(mount_point)], check=True)


@pytest.fixture
def small_disk(tmp_path):
    with _tmpfs(tmp_path / "small_disk", "3m") as mount_point:
        yield mount_point


def test_real_full_disk(small_disk):
    ckpt = _checkpointer(small_disk, keep=1)
    failures: list[str] = []
    ckpt.on_failure = lambda step, message: failures.append(message)
    big = {"w": torch.full((512, 512), 1.0)}  # 1 MiB
    ckpt.save(1, big, permanent=False)
    filler = small_disk / "filler"
    filler.write_bytes(b"x" * (shutil.disk_usage(small_disk).free - (256 << 10)))
    ckpt.save(2, {"w": torch.full((512, 512), 2.0)}, permanent=False)
    assert len(failures) == 1
    assert re.fullmatch(_disk_full_message(2, small_disk), failures[0]), failures[0]
    failed_mb, began_mb, needed_mb = map(float, re.findall(r"([\d.]+) MB", failures[0]))
    assert failed_mb <= began_mb < needed_mb and needed_mb == pytest.approx(1.0, abs=0.01)
    assert sorted(p.name for p in small_disk.iterdir()) == ["filler", "step-00000001"]
    filler.unlink()

    # The disk fills up during the save (another writer): it had room as the save began, and
    # the report says both.
    real_writer = ckpt.storage.dcp_writer

    def writer_racing_a_filler(path):
        writer = real_writer(path)
        write_data = writer.write_data

        def fill_then_write(*args, **kwargs):
            filler.write_bytes(b"x" * (shutil.disk_usage(small_disk).free - (64 << 10)))
            return write_data(*args, **kwargs)

        writer.write_data = fill_then_write
        return writer

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ckpt.storage, "dcp_writer", writer_racing_a_filler)
        ckpt.save(3, {"w": torch.full((512, 512), 3.0)}, permanent=False)
    assert len(failures) == 2
    assert re.fullmatch(_disk_full_message(3, small_disk), failures[1]), failures[1]
    failed_mb, began_mb, needed_mb = map(float, re.findall(r"([\d.]+) MB", failures[1]))
    assert failed_mb < 0.1 and needed_mb == pytest.approx(1.0, abs=0.01)
    assert began_mb > needed_mb
    filler.unlink()
    target = {"w": torch.zeros(512, 512)}
    assert _checkpointer(small_disk).restore_latest(target) == 1
    assert float(target["w"][0, 0]) == 1.0


def test_async_save_commits_after_wait(tmp_path):
    ckpt = _checkpointer(tmp_path, async_mode="thread")
    state = _state(3.0)
    ckpt.save(4, state, permanent=False)
    state["model"]["w"].fill_(99.0)  # training goes on: the save holds its own copy
    ckpt.wait()
    assert _restored(_checkpointer(tmp_path)) == (4, 3.0)


def test_training_on_a_full_disk_reports_each_failure_and_stops(tmp_path):
    """The user's view: a run whose checkpoint disk holds one checkpoint (~10 MB) but not two."""
    fields = {
        "training__steps": 6,
        "training__global_batch_size": 4,
        "training__micro_batch_size": 4,
        "training__seq_len": 32,
        "checkpoint__interval_steps": 2,
        "checkpoint__keep_temporary": 1,
    }
    with _tmpfs(tmp_path / "disk", "16m") as disk:
        # Saves at 2 (fits), 4 and 6 (no room beside step 2): two failures, then it finishes.
        # Written in the background: a failed background save never stops training either.
        run = tmp_path / "finishes"
        train_in_process(run, **fields, checkpoint__dir=disk / "a", checkpoint__async_mode="thread")
        failed = [r for r in read_metrics(run / "metrics.jsonl") if "checkpoint_failed" in r]
        assert [r["step"] for r in failed] == [4, 6]
        assert re.fullmatch(_disk_full_message(4, disk / "a"), failed[0]["checkpoint_error"])
        named = diagnose(run)
        assert "checkpoint saves: 3, 2 failed; last (step 6)" in named, named
        assert named.count("  failed save: checkpoint step-0000000") == 2, named
        log = (run / "logs" / "rank0.log").read_text()
        assert "finished 6 steps (newest committed checkpoint: step-00000002)" in log
        assert sorted(p.name for p in (disk / "a").iterdir()) == ["OWNER.json", "step-00000002"]
        shutil.rmtree(disk / "a")

        run = tmp_path / "stops"
        with pytest.raises(CheckpointError) as stopped:
            train_in_process(
                run, **fields, checkpoint__dir=disk / "b", checkpoint__max_failed_saves=2
            )
        assert re.match(_disk_full_message(6, disk / "b"), str(stopped.value))
        assert str(stopped.value).endswith("newest committed checkpoint: step-00000002")
        assert sorted(p.name for p in (disk / "b").iterdir()) == ["OWNER.json", "step-00000002"]
        (intact,) = committed(Storage(str(disk / "b")))
        assert intact.step == 2 and manifest.verify(Storage(str(disk / "b")), intact) is None


# --- two ranks: ZeRO-1 shards, shared verification, a failure on one rank ------------------


def _adamw_pair(zero: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    group = dist.group.WORLD if zero else None
    return model, build_optimizer(model, OptimConfig(lr=0.1), zero1_group=group)


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int = 3) -> None:
    torch.manual_seed(1)  # the same batches on every rank and in the reference
    for _ in range(steps):
        model(torch.randn(5, 8)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def _two_rank_worker(rank: int, tmp_path) -> None:
    torch.set_num_threads(1)  # all ranks share 2 cores
    with process_group(rank, 2, store_file=tmp_path / "store"):
        report: dict = {}
        storage = Storage(str(tmp_path / "ckpt"))
        ckpt = Checkpointer(
            storage, run_id="test", layout="dp2", async_mode="off", keep_temporary=5, logger=LOG
        )
        report["group_is_own"] = ckpt.group is not None and ckpt.group != dist.group.WORLD

        # ZeRO-1: each rank saves the state of its own partition; nothing is consolidated.
        from torch.distributed.optim import ZeroRedundancyOptimizer

        def no_gather(*_args, **_kwargs):
            raise AssertionError("a ZeRO-1 save must not consolidate the optimizer state")

        ZeroRedundancyOptimizer.consolidate_state_dict = no_gather
        model, zero = _adamw_pair(zero=True)
        _train(model, zero)
        flat = optimizer_state_dict(model, zero)
        report["state_keys"] = sorted(k for k in flat if k.startswith("state."))
        ckpt.save(3, {"optim": flat}, permanent=False)

        # Resume: each rank hashes its share of the files; the verdicts are combined.
        hashed: list[str] = []
        real_sha256 = Storage.sha256

        def counting_sha256(self, path, **kwargs):
            hashed.append(path.rsplit("/", 1)[-1])
            return real_sha256(self, path, **kwargs)

        Storage.sha256 = counting_sha256
        target = optimizer_state_dict(*_adamw_pair(zero=True))
        report["restored"] = ckpt.restore_latest({"optim": target})
        report["hashed"] = hashed
        Storage.sha256 = real_sha256

        # A full disk on rank 1 only fails the save on both ranks and removes its directory.
        real_writer = ckpt.storage.dcp_writer

        def full_on_rank1(path):
            writer = real_writer(path)
            if rank == 1:

                def no_space(*_args, **_kwargs):
                    raise OSError(errno.ENOSPC, "No space left on device")

                writer.write_data = no_space
            return writer

        ckpt.storage.dcp_writer = full_on_rank1
        failures: list[str] = []
        ckpt.on_failure = lambda step, message: failures.append(message)
        ckpt.save(4, {"optim": flat}, permanent=False)
        report["failures"] = failures
        report["newest"] = ckpt.newest_committed
        (tmp_path / f"rank{rank}.json").write_text(json.dumps(report))
        dist.barrier()


@pytest.mark.slow
def test_two_ranks_zero1_shards_shared_verification_and_one_rank_failing(tmp_path):
    mp.spawn(_two_rank_worker, args=(tmp_path,), nprocs=2)
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert all(r["group_is_own"] for r in reports)

    # Each rank held the state of a disjoint share of the parameters, together all of them.
    keys = [set(r["state_keys"]) for r in reports]
    assert keys[0] and keys[1] and not keys[0] & keys[1]
    model, reference = _adamw_pair(zero=False)
    _train(model, reference)
    want = optimizer_state_dict(model, reference)
    assert keys[0] | keys[1] == {k for k in want if k.startswith("state.")}

    # The shards load as one plain AdamW state, equal to a plain AdamW trained alike.
    got = optimizer_state_dict(*_adamw_pair(zero=False))
    step3 = str(tmp_path / "ckpt" / "step-00000003")
    load.load(Storage(str(tmp_path / "ckpt")), step3, {"optim": got})
    for key in want:
        if key.startswith("state."):
            torch.testing.assert_close(got[key], want[key], rtol=0, atol=0)

    # Verification: each rank hashed a different half of the files, together all of them.
    assert all(r["restored"] == 3 for r in reports)
    manifest = json.loads((tmp_path / "ckpt" / "step-00000003" / "MANIFEST.json").read_text())
    hashed = [set(r["hashed"]) for r in reports]
    assert hashed[0] and hashed[1] and not hashed[0] & hashed[1]
    assert hashed[0] | hashed[1] == set(manifest["files"])

    # The failure on rank 1 failed the save on both ranks, said why, and left step 3 newest.
    for r in reports:
        assert len(r["failures"]) == 1 and r["failures"][0].startswith(
            "checkpoint step-00000004 not saved: disk full on "
        )
        assert r["newest"] == 3
    assert not (tmp_path / "ckpt" / "step-00000004").exists()


def test_tied_head_copy_keeps_its_optimizer_state_under_the_embedding_name():
    """A pipeline's last stage holds its own copy of a tied embedding as its head; its optimizer
    state is saved and loaded under the embedding's name, as one process names the one shared
    weight, so a checkpoint moves between pipeline and other layouts."""
    from distrain.models.decoder.model import Decoder, ModelArgs
    from distrain.models.gpt.spec import GPT_SPEC
    from distrain.optim.state_dict import OptimizerState
    from distrain.parallel.pipeline import split_model

    args = ModelArgs(
        vocab_size=64,
        dim=32,
        n_layers=2,
        n_heads=4,
        ffn_dim=64,
        max_seq_len=16,
        tie_embeddings=True,
    )
    torch.manual_seed(0)
    whole = Decoder(args)
    head = split_model(Decoder(args), 1, 2, spec=GPT_SPEC)
    tokens = torch.randint(64, (2, 8))
    optimizers = []
    for model, inputs in ((whole, tokens), (head, torch.randn(2, 8, 32))):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model(inputs).sum().backward()
        optimizer.step()
        optimizers.append(optimizer)
    saved = OptimizerState([whole], optimizers[:1], GPT_SPEC).state_dict()
    head_state = OptimizerState([head], optimizers[1:], GPT_SPEC)
    assert "state.tok_emb.weight.exp_avg" in head_state.state_dict()
    assert not any("output.weight" in key for key in [*saved, *head_state.state_dict()])
    head_state.load_state_dict(saved)
    loaded = optimizers[1].state[head.output.weight]["exp_avg"]
    assert torch.equal(loaded, optimizers[0].state[whole.tok_emb.weight]["exp_avg"])


# --- every rank agrees: a save failing on one non-zero rank, a damaged file in its share ------


def _agreement_worker(rank: int, world: int, tmp_path) -> None:
    torch.set_num_threads(1)  # all ranks share 2 cores
    last = world - 1  # the rank that fails, and whose share of the files is damaged
    # Ranks that disagree meet different collectives: a timeout fails the test, not a hang.
    with process_group(rank, world, store_file=tmp_path / "store", timeout_s=60):
        storage = Storage(str(tmp_path / "ckpt"))
        ckpt = Checkpointer(
            storage,
            run_id="test",
            layout=f"dp{world}",
            async_mode="off",
            keep_temporary=5,
            logger=LOG,
            collective_timeout_s=60,
        )

        def state(value: float) -> dict:
            return {"model": {f"w{rank}": torch.full((16, 16), value)}}  # a file per rank

        ckpt.save(1, state(1.0), permanent=False)
        # Step 2: the last rank's files and record are written, but its storage reports the
        # record's write as failed (an object store whose acknowledgement was lost): a save that
        # failed on that rank alone, which every rank must settle as failed.
        real_write = storage.write_text_atomic

        def lost_acknowledgement(path, text):
            real_write(path, text)
            raise OSError("the acknowledgement of the write was lost")

        if rank == last:
            storage.write_text_atomic = lost_acknowledgement
        failures: list[str] = []
        ckpt.on_failure = lambda step, message: failures.append(message)
        ckpt.save(2, state(2.0), permanent=False)
        storage.write_text_atomic = real_write
        report = {"failures": failures, "newest": ckpt.newest_committed}
        (tmp_path / f"settled{rank}.json").write_text(json.dumps(report))

        # Step 3 commits; then one of its files in the last rank's share of the verification
        # is damaged. Only that rank finds the damage; every rank must resume step 1.
        ckpt.save(3, state(3.0), permanent=False)
        dist.barrier()
        step3 = tmp_path / "ckpt" / "step-00000003"
        names = sorted(json.loads((step3 / "MANIFEST.json").read_text())["files"])
        damaged = names[last::world][0]
        if rank == 0:
            data = bytearray((step3 / damaged).read_bytes())
            data[-1] ^= 0xFF
            (step3 / damaged).write_bytes(bytes(data))
        dist.barrier()
        target = state(0.0)
        restored = ckpt.restore_latest(target)
        report = {
            "damaged": damaged,
            "restored": restored,
            "value": float(target["model"][f"w{rank}"][0, 0]),
        }
        (tmp_path / f"restored{rank}.json").write_text(json.dumps(report))
        dist.barrier()


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_every_rank_settles_a_save_and_picks_a_checkpoint_alike(tmp_path, world):
    """A save that fails on the last rank only is failed on every rank (nobody commits it),
    and a file damaged in the last rank's share of the verification makes every rank skip that
    checkpoint: all resume the same, earlier step."""
    try:
        mp.spawn(_agreement_worker, args=(world, tmp_path), nprocs=world)
        crashed = None
    except mp.ProcessRaisedException as e:  # ranks that disagreed: their verdicts first
        crashed = e
    settled = [json.loads((tmp_path / f"settled{r}.json").read_text()) for r in range(world)]
    for r, report in enumerate(settled):
        assert report["newest"] == 1, (r, report)
        assert len(report["failures"]) == 1, (r, report)
        assert report["failures"][0].startswith("checkpoint step-00000002 not saved: "), r
        assert f"failed on rank {world - 1} " in report["failures"][0], (r, report)
    assert not (tmp_path / "ckpt" / "step-00000002").exists()
    assert crashed is None, crashed

    restored = [json.loads((tmp_path / f"restored{r}.json").read_text()) for r in range(world)]
    # The damaged file is one that the last rank alone hashes.
    assert restored[0]["damaged"].endswith(".distcp"), restored[0]
    for r, report in enumerate(restored):
        assert (report["restored"], report["value"]) == (1, 1.0), (r, report)
