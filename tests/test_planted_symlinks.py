"""Files distrain writes into folders others may write too (a run dir, a dataset folder) never
write through a symlink planted at their name, at a temporary name or at a subfolder's name:
each file is created fresh (O_EXCL | O_NOFOLLOW) and renamed over the target, which replaces a
link instead of following it, or, for logs and streams, opened with O_NOFOLLOW and refused in
one line; a subfolder distrain makes in a run dir is refused when it is a link.

Every writer into a run dir is run here with a link planted at the name it writes, pointing to
a victim file (or folder) outside: the run dir's config.toml, metrics.jsonl, rank logs,
heartbeats, trackers.json, the trackers' config.toml, summary.json and plot, the watchdog's
hang.json, stacks, hangs.jsonl, reported.N and flight record, the profiler's trace, the run
lock's and run id's private files, and the folders logs/, heartbeat/, flight/, tracked/,
plots/, profiles/."""

from __future__ import annotations

import logging
import time
import uuid
from pathlib import Path

import pytest
import torch
from helpers import train_in_process

from distrain.config.schema import ProfileConfig
from distrain.data.prepare import prepare
from distrain.files import (
    SymlinkRefused,
    make_dir,
    open_append,
    write_atomic,
    write_new,
    write_with,
)
from distrain.launch import rundir
from distrain.observe import watchdog
from distrain.observe.heartbeat import Heartbeat
from distrain.observe.metrics import MetricsWriter
from distrain.observe.profiling import StepProfiler
from distrain.observe.trackers import read_ids
from distrain.observe.watchdog import HANG_EXIT_CODE, Watchdog

RUN = {"training__steps": 2, "training__global_batch_size": 8, "training__micro_batch_size": 8,
       "training__seq_len": 32, "checkpoint__interval_steps": 0}  # fmt: skip
PRECIOUS = "precious"
"""The victim's content: no last newline, which a torn-line repair would cut."""


@pytest.fixture
def victim(tmp_path):
    path = tmp_path / "victim.txt"
    path.write_text(PRECIOUS)
    return path


@pytest.fixture
def victim_dir(tmp_path):
    path = tmp_path / "victim_dir"
    path.mkdir()
    return path


def _one_line_refusal(info: pytest.ExceptionInfo, name: str) -> None:
    message = str(info.value)
    assert f"{name} is a symlink" in message and "\n" not in message, message


def test_atomic_writes_replace_a_planted_link_and_append_refuses_one(tmp_path, victim):
    target = tmp_path / "folder" / "config.toml"
    target.parent.mkdir()
    target.symlink_to(victim)
    write_atomic(target, "new\n")
    assert victim.read_text() == PRECIOUS and not target.is_symlink()
    assert target.read_text() == "new\n"
    log = tmp_path / "folder" / "metrics.jsonl"
    log.symlink_to(victim)
    with pytest.raises(SymlinkRefused) as info:
        open_append(log)
    _one_line_refusal(info, "metrics.jsonl")
    assert victim.read_text() == PRECIOUS


def test_a_file_a_library_writes_by_name_replaces_a_planted_link(tmp_path, victim):
    """write_with hands the library (torch's trace and memory-snapshot writers) a name in a
    private folder; the library's own open, which follows links, never sees the target."""
    target = tmp_path / "trace.json"
    target.symlink_to(victim)
    write_with(target, lambda name: Path(name).write_text("new"))  # follows a link itself
    assert victim.read_text() == PRECIOUS and not target.is_symlink()
    assert target.read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trace.json", "victim.txt"]


def test_a_new_file_refuses_a_link_at_its_name_and_a_linked_subfolder_is_refused(
    tmp_path, victim, victim_dir
):
    private = tmp_path / ".run.lock.private"
    private.symlink_to(victim)
    with pytest.raises(SymlinkRefused) as info:
        write_new(private, "{}")
    _one_line_refusal(info, ".run.lock.private")
    (tmp_path / "profiles").symlink_to(victim_dir, target_is_directory=True)
    with pytest.raises(SymlinkRefused) as info:
        make_dir(tmp_path, "profiles/rank0")
    _one_line_refusal(info, "profiles")
    assert victim.read_text() == PRECIOUS and not any(victim_dir.iterdir())
    assert make_dir(tmp_path / "link-free", "a/b").is_dir()


def test_a_run_dir_with_planted_links_writes_none_of_their_targets(tmp_path, victim):
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    (run / "heartbeat").mkdir()
    for name in ("config.toml", ".trackers.json.tmp", "heartbeat/rank0.json"):
        (run / name).symlink_to(victim)
    train_in_process(run, **RUN)
    assert victim.read_text() == PRECIOUS
    assert not (run / "config.toml").is_symlink()
    assert not (run / "heartbeat" / "rank0.json").is_symlink()


@pytest.mark.parametrize("name", ["metrics.jsonl", "logs/rank0.log"])
def test_a_planted_stream_link_stops_the_run_in_one_line(tmp_path, victim, name):
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    (run / name).symlink_to(victim)
    with pytest.raises(SymlinkRefused) as info:
        train_in_process(run, **RUN)
    _one_line_refusal(info, name.split("/")[-1])
    assert victim.read_text() == PRECIOUS


def test_metrics_jsonl_linked_to_a_file_without_a_last_newline_is_not_cut(tmp_path, victim):
    """The torn-line repair of a restarted run's metrics.jsonl runs on the file opened without
    following a link: a link to a file whose last line has no newline is refused, not cut."""
    (tmp_path / "metrics.jsonl").symlink_to(victim)
    with pytest.raises(SymlinkRefused):
        MetricsWriter(tmp_path, enabled=True, tensorboard=False)
    assert victim.read_text() == PRECIOUS
    # The repair itself, on a real file: the torn line goes, the next attempt appends after.
    real = tmp_path / "real"
    real.mkdir()
    (real / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo')
    writer = MetricsWriter(real, enabled=True, tensorboard=False)
    writer.log({"step": 2, "loss": 1.5})
    writer.close()
    assert (real / "metrics.jsonl").read_text() == (
        '{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5, "attempt": 1}\n'
    )


@pytest.mark.parametrize("folder", ["logs", "heartbeat"])
def test_a_linked_run_dir_subfolder_stops_the_run_in_one_line(tmp_path, victim_dir, folder):
    run = tmp_path / "run"
    run.mkdir()
    (run / folder).symlink_to(victim_dir, target_is_directory=True)
    with pytest.raises(SymlinkRefused) as info:
        train_in_process(run, **RUN)
    _one_line_refusal(info, folder)
    assert not any(victim_dir.iterdir())


def test_the_trackers_files_replace_planted_links(tmp_path, victim):
    """trackers.json, the trackers' config.toml, summary.json and the plot of an offline W&B
    run: links planted at each are replaced, none followed."""
    pytest.importorskip("wandb")
    run = tmp_path / "run"
    (run / "tracked").mkdir(parents=True)
    (run / "plots").mkdir()
    names = ["trackers.json", "tracked/config.toml", "summary.json", "plots/metrics.png"]
    for name in names:
        (run / name).symlink_to(victim)
    train_in_process(run, **RUN, metrics__wandb__mode="offline", metrics__wandb__project="links")
    assert victim.read_text() == PRECIOUS
    assert not any((run / name).is_symlink() for name in names)
    assert "wandb" in read_ids(run) and (run / "plots" / "metrics.png").stat().st_size > 0


@pytest.mark.parametrize("folder", ["tracked", "plots"])
def test_a_linked_trackers_folder_is_refused_and_the_run_ends_well(tmp_path, victim_dir, folder):
    """An artifact is a convenience: its refusal is one warning; the trackers still end."""
    pytest.importorskip("wandb")
    run = tmp_path / "run"
    run.mkdir()
    (run / folder).symlink_to(victim_dir, target_is_directory=True)
    train_in_process(run, **RUN, metrics__wandb__mode="offline", metrics__wandb__project="links")
    warnings = [
        line for line in (run / "logs" / "rank0.log").read_text().splitlines()
        if f"{folder} is a symlink" in line
    ]  # fmt: skip
    assert len(warnings) == 1 and "trackers: no " in warnings[0]
    assert not any(victim_dir.iterdir())


def _watchdog(run, timeout_s: float = 600.0) -> Watchdog:
    hb = Heartbeat(run, 0, 1)
    return Watchdog(hb, run_dir=run, timeout_s=timeout_s, logger=logging.getLogger("t"), nccl=False)


@pytest.mark.parametrize(
    "name",
    ["heartbeat/hang.json", "heartbeat/reported.0", "flight/rank0.json", "logs/rank0.stacks",
     "hangs.jsonl"],
)  # fmt: skip
def test_the_watchdogs_hang_report_writes_through_no_planted_link(tmp_path, victim, name):
    run = tmp_path / "run"
    for folder in ("heartbeat", "flight", "logs"):
        (run / folder).mkdir(parents=True)
    (run / name).symlink_to(victim)
    dog = _watchdog(run)
    if name.endswith((".stacks", ".jsonl")):  # streams: refused
        with pytest.raises(SymlinkRefused) as info:
            dog._on_hang(700.0)
        _one_line_refusal(info, name.split("/")[-1])
    else:  # whole files: replaced
        dog._on_hang(700.0)
        assert not (run / name).is_symlink() and (run / "hangs.jsonl").is_file()
    assert victim.read_text() == PRECIOUS


def test_a_refused_hang_report_is_one_logged_line_before_the_exit(
    tmp_path, victim, monkeypatch, caplog
):
    """The watchdog leaves through os._exit, which would swallow the refusal: it is logged."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "hangs.jsonl").symlink_to(victim)
    dog = _watchdog(run, timeout_s=0.8)

    def exit_(code: int) -> None:
        raise SystemExit(code)

    monkeypatch.setattr(watchdog.os, "_exit", exit_)
    start = time.monotonic()
    with caplog.at_level(logging.ERROR, logger="t"), pytest.raises(SystemExit) as ended:
        dog._loop()
    assert ended.value.code == HANG_EXIT_CODE and time.monotonic() - start < 30
    refusals = [r.getMessage() for r in caplog.records if "is a symlink" in r.getMessage()]
    assert len(refusals) == 1 and "hangs.jsonl is a symlink" in refusals[0]
    assert "\n" not in refusals[0] and victim.read_text() == PRECIOUS


def _profile(run) -> None:
    cfg = ProfileConfig(start_step=1, num_steps=1)
    profiler = StepProfiler(
        cfg, run_dir=run, rank=0, world_size=1, device=torch.device("cpu"),
        logger=logging.getLogger("t"),
    )  # fmt: skip
    profiler.before_step(1)
    torch.ones(4).sum()
    profiler.step_end(1)


def test_the_profilers_trace_replaces_a_planted_link(tmp_path, victim, victim_dir):
    run = tmp_path / "run"
    (run / "profiles" / "rank0").mkdir(parents=True)
    trace = run / "profiles" / "rank0" / "trace.json"
    trace.symlink_to(victim)
    _profile(run)
    assert victim.read_text() == PRECIOUS
    assert not trace.is_symlink() and "traceEvents" in trace.read_text()
    assert sorted(p.name for p in trace.parent.iterdir()) == ["trace.json"]
    other = tmp_path / "other"
    other.mkdir()
    (other / "profiles").symlink_to(victim_dir, target_is_directory=True)
    with pytest.raises(SymlinkRefused) as info:
        _profile(other)
    _one_line_refusal(info, "profiles")
    assert not any(victim_dir.iterdir())


def test_the_run_locks_and_run_ids_private_files_refuse_a_planted_link(
    tmp_path, victim, monkeypatch
):
    """Their names are random; made predictable here, a link planted there is refused."""
    fixed = uuid.UUID(int=7)
    monkeypatch.setattr(rundir.uuid, "uuid4", lambda: fixed)
    run = tmp_path / "run"
    run.mkdir()
    holder = rundir.LockHolder.me()
    (run / f".run.lock.{holder.host}.{holder.pid}.{fixed.hex}").symlink_to(victim)
    (run / f".run_id.{fixed.hex}").symlink_to(victim)
    with pytest.raises(SymlinkRefused) as info:
        rundir.RunDirLock(run).acquire()
    _one_line_refusal(info, f".run.lock.{holder.host}.{holder.pid}.{fixed.hex}")
    with pytest.raises(SymlinkRefused) as info:
        rundir.run_id(run)
    _one_line_refusal(info, f".run_id.{fixed.hex}")
    assert victim.read_text() == PRECIOUS
    assert not (run / "run.lock").exists() and not (run / "run_id").exists()


def test_prepare_writes_through_no_planted_link(tmp_path, victim):
    text = tmp_path / "text"
    text.mkdir()
    (text / "a.txt").write_text("alpha beta gamma " * 200)
    out = tmp_path / "data"
    out.mkdir()
    for name in ("index.json.tmp", "index.json", "shard-00000.bin.tmp"):
        (out / name).symlink_to(victim)
    prepare([str(text)], out=str(out), tokenizer="bytes", shard_tokens=1000)
    assert victim.read_text() == PRECIOUS
    assert not (out / "index.json").is_symlink() and (out / "index.json").stat().st_size > 0


# --- the commands that write into a run dir, and export's copies ---------------------------------


def test_slurm_script_replaces_a_planted_link_and_leaves_its_target_and_mode(tmp_path, victim):
    """`distrain slurm`'s RUN/slurm.sbatch: was written through the link and the victim made 755."""
    from distrain.launch.slurm import SCRIPT_NAME, SlurmJob, write_script

    run = tmp_path / "run"
    run.mkdir()
    victim.chmod(0o600)
    (run / SCRIPT_NAME).symlink_to(victim)
    job = SlurmJob(
        min_nodes=1, max_nodes=1, grace_s=90, run_dir=run, python="python3", train_argv=[]
    )
    path = write_script(job)
    assert victim.read_text() == PRECIOUS and victim.stat().st_mode & 0o777 == 0o600
    assert not path.is_symlink() and path.stat().st_mode & 0o777 == 0o755
    assert path.read_text().startswith("#!")


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A run of a family with a Hugging Face equivalent, with a checkpoint at its step 2."""
    run = tmp_path_factory.mktemp("trained") / "run"
    train_in_process(run, **RUN, model__family="llama", model__preset="llama-tiny")
    return run


def test_eval_results_replace_a_planted_link_and_a_linked_eval_folder_is_refused(
    trained, victim, victim_dir, monkeypatch
):
    """`distrain eval`'s RUN/eval/step-N.json (the harness itself stubbed: what is tested is
    where its results go)."""
    tasks = pytest.importorskip("lm_eval.tasks")
    import lm_eval

    from distrain.evaluate.downstream import run_eval

    class Tasks:
        all_tasks = ("fake",)

        def __init__(self, **_: object) -> None:
            pass

    monkeypatch.setattr(tasks, "TaskManager", Tasks)
    monkeypatch.setattr(
        lm_eval, "simple_evaluate", lambda **_: {"results": {"fake": {"acc,none": 0.5}}}
    )
    eval_dir = trained / "eval"
    eval_dir.mkdir()
    (eval_dir / "step-00000002.json").symlink_to(victim)
    path, _ = run_eval(trained, tasks=["fake"])
    assert path == eval_dir / "step-00000002.json"
    assert victim.read_text() == PRECIOUS and not path.is_symlink()
    assert '"fake"' in path.read_text()
    for entry in eval_dir.iterdir():
        entry.unlink()
    eval_dir.rmdir()
    eval_dir.symlink_to(victim_dir, target_is_directory=True)
    with pytest.raises(SymlinkRefused) as info:
        run_eval(trained, tasks=["fake"])
    _one_line_refusal(info, "eval")
    assert not any(victim_dir.iterdir())
    eval_dir.unlink()


@pytest.mark.parametrize("linked", ["special_tokens_map.json", "tokenizer.json"])
def test_export_copies_no_tokenizer_file_that_is_a_link(trained, tmp_path, linked):
    """`data.tokenizer = "hf:DIR"` whose DIR/<linked> is a link to a secret: the export stops in
    one line naming it, and the secret is nowhere in the export."""
    from distrain.interop.export import export_hf

    secret = tmp_path / "secret.key"
    secret.write_text("SECRET-KEY-MATERIAL")
    secret.chmod(0o600)
    tokenizer = tmp_path / "tok"
    tokenizer.mkdir()
    bpe = Path(__file__).parent / "data" / "bpe-300.json"
    (tokenizer / "tokenizer.json").write_bytes(bpe.read_bytes())
    (tokenizer / "tokenizer_config.json").write_text("{}")
    (tokenizer / linked).unlink(missing_ok=True)
    (tokenizer / linked).symlink_to(secret)
    if linked == "tokenizer.json":  # the tokenizer is read through the link: a real one there
        secret.write_bytes(bpe.read_bytes() + b"\n" + b" " * 10 + b"\n")
    config = trained / "config.toml"
    original = config.read_text()
    config.write_text(original.replace('tokenizer = "bytes"', f'tokenizer = "hf:{tokenizer}"'))
    assert config.read_text() != original
    out = tmp_path / "export"
    try:
        with pytest.raises(SymlinkRefused) as info:
            export_hf(trained, out)
    finally:
        config.write_text(original)
    message = str(info.value)
    assert f"{linked} is a symlink or not a regular file" in message and "\n" not in message
    secret_bytes = secret.read_bytes()
    assert not any(p.read_bytes() == secret_bytes for p in out.rglob("*") if p.is_file())
    assert not (out / linked).exists()
