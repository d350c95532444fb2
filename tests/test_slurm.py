"""Slurm, for real: jobs submitted by `distrain slurm` to a Slurm cluster started by the test
(tests/slurm.py: munged, slurmctld, slurmd on this machine), plus the script's content and the
srun environment contract checked without one.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import SMALL_RUN, cli_in_process, losses, overrides
from slurm import multiple_slurmd_supported, slurm, slurm_cluster, slurm_unavailable  # noqa: F401

from distrain.checkpoint.manifest import committed
from distrain.checkpoint.storage import Storage
from distrain.errors import ConfigError
from distrain.launch.preempt import EXIT_PREEMPTED
from distrain.launch.slurm import (
    SlurmJob,
    first_host,
    parse_nodes,
    parse_time_s,
    sbatch_script,
    srun_task_env,
)
from distrain.observe.metrics import read_metrics

# A test that skips for want of Slurm fails instead where DISTRAIN_REQUIRE names slurm (CI).
pytestmark = pytest.mark.requires("slurm")

STEPS = 16
FIELDS = {
    "training__steps": STEPS,
    **SMALL_RUN,
    "checkpoint__interval_steps": 0,
    "checkpoint__at_end": True,
    "checkpoint__preempt_grace_s": 60,
}


def train_options(run: Path, nproc: int | None = 2, **fields: object) -> list[str]:
    args = ["--nproc", str(nproc)] if nproc is not None else []
    for key, value in overrides(run, **dict(FIELDS, **fields)):
        args += [f"--{key}", value]
    return args


def submit(
    cluster, workdir: Path, *slurm_args: str, run: Path, nproc: int = 2, **fields: object
) -> str:
    """`distrain slurm ... -- train options` from `workdir`; returns the job id. The job
    inherits OMP_NUM_THREADS=1, which torchrun sets only with several workers per node: the
    same intra-op threading in every layout keeps float reductions in the same order."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "distrain",
            "slurm",
            *slurm_args,
            "--",
            *train_options(run, nproc, **fields),
        ],
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=120,
        env=cluster.child_env(OMP_NUM_THREADS="1"),
    )
    assert result.returncode == 0, result.stderr[-4000:]
    match = re.search(r"submitted job (\d+)", result.stdout)
    assert match, result.stdout
    return match[1]


def job_output(workdir: Path, job_id: str) -> str:
    out = workdir / f"slurm-{job_id}.out"
    return out.read_text() if out.exists() else "(no output)"


def complete(run: Path) -> None:
    """The run dir of a finished run: config, metrics of every step, per-rank logs, and a
    committed checkpoint of the last step."""
    assert (run / "config.toml").exists()
    assert {r["step"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r} == set(
        range(1, STEPS + 1)
    )
    for rank in (0, 1):
        assert f"finished {STEPS} steps" in (run / "logs" / f"rank{rank}.log").read_text()
    assert [e.step for e in committed(Storage(str(run / "checkpoints")))][-1] == STEPS


@pytest.fixture(scope="module")
def slurm_reference(slurm, tmp_path_factory) -> tuple[Path, Path, str]:  # noqa: F811
    """A 2-process job (one node, 2 workers) submitted by `distrain slurm`, run to completion:
    (submit dir, run dir, job id)."""
    workdir = tmp_path_factory.mktemp("slurm-ref")
    run = workdir / "run"
    job_id = submit(slurm, workdir, "--nodes", "1", run=run)
    fields = slurm.wait_state(job_id, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"})
    assert fields["JobState"] == "COMPLETED", job_output(workdir, job_id) + slurm.log_tail()
    return workdir, run, job_id


@pytest.mark.slow
def test_a_two_process_job_runs_to_completion(slurm_reference):
    workdir, run, job_id = slurm_reference
    complete(run)
    out = job_output(workdir, job_id)
    assert f"per-rank logs in {run}/logs/rank<N>.log" in out
    assert (run / "slurm.sbatch").exists()


@pytest.mark.slow
def test_a_job_signalled_mid_run_checkpoints_requeues_and_ends_with_the_same_loss(
    slurm,  # noqa: F811
    slurm_reference,
    tmp_path,
):
    workdir, run = tmp_path, tmp_path / "run"
    job_id = submit(slurm, workdir, "--requeue", run=run)
    slurm.wait_state(job_id, {"RUNNING"})
    metrics = run / "metrics.jsonl"
    wait_until(lambda: metrics.exists() and metrics.read_text().count("\n") >= 2, job_id, workdir)
    # What Slurm does at `--signal=B:USR1@grace` before the time limit or on preemption.
    slurm.run("scancel", "--signal=USR1", "--batch", job_id)
    wait_until(lambda: slurm.job(job_id).get("Restarts") == "1", job_id, workdir)
    # Slurm holds a requeued job back for 121 s (BeginTime); let it start now, but not within
    # the second its old credential was revoked in: slurmd compares whole seconds and would
    # refuse the new one too ("Job credential revoked"; the job then ends FAILED).
    time.sleep(2)
    slurm.run("scontrol", "update", f"JobId={job_id}", "StartTime=now")
    fields = slurm.wait_state(job_id, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}, timeout=600)
    out = job_output(workdir, job_id)
    assert fields["JobState"] == "COMPLETED", out + slurm.log_tail()
    assert fields["Restarts"] == "1", fields
    assert "distrain: SIGUSR1: stopping with a checkpoint" in out
    assert f"requeueing job {job_id}" in out
    kinds = [e.kind for e in committed(Storage(str(run / "checkpoints")))]
    assert kinds[-1] == "permanent"  # the end of the resumed run; the preempt one superseded
    log = (run / "logs" / "rank0.log").read_text()
    stopped = re.search(r"stopped by SIGUSR1 after step (\d+)", log)
    assert stopped, log[-3000:]
    assert f"resumed from checkpoint step-{int(stopped[1]):08d}" in log
    complete(run)
    _, reference_run, _ = slurm_reference
    assert losses(read_metrics(metrics)) == losses(read_metrics(reference_run / "metrics.jsonl"))


@pytest.mark.slow
def test_two_slurm_nodes_run_one_job(slurm_reference, tmp_path):
    """Two slurmd on this machine (multiple-slurmd mode), one worker each: one 2-rank run."""
    if not multiple_slurmd_supported():
        pytest.skip(
            "this slurmd build lacks --enable-multiple-slurmd (slurmd -N NAME), which two "
            "nodes on one machine need"
        )
    with slurm_cluster(2) as cluster:
        run = tmp_path / "run"
        job_id = submit(cluster, tmp_path, "--nodes", "2", run=run, nproc=1)
        fields = cluster.wait_state(job_id, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"})
        out = job_output(tmp_path, job_id)
        assert fields["JobState"] == "COMPLETED", out + cluster.log_tail()
        assert fields["NodeList"] == "node[0-1]", fields
    assert "on 2 node(s): node[0-1]" in out
    complete(run)
    # Same 2 ranks, same reduction: the 2-node run's losses are the 1-node run's, bit for bit.
    _, reference_run, _ = slurm_reference
    assert losses(read_metrics(run / "metrics.jsonl")) == losses(
        read_metrics(reference_run / "metrics.jsonl")
    )


@pytest.mark.slow
def test_distrain_train_under_srun_runs_one_rank_per_task(slurm, slurm_reference, tmp_path):  # noqa: F811
    run = tmp_path / "run"
    result = subprocess.run(
        [
            "srun",
            "--ntasks=2",
            "--nodes=1",
            sys.executable,
            "-m",
            "distrain",
            "train",
            *train_options(run, nproc=None),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        env=slurm.child_env(OMP_NUM_THREADS="1"),
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert "rank 1/2 on cpu (gloo)" in (run / "logs" / "rank1.log").read_text()
    complete(run)
    _, reference_run, _ = slurm_reference
    assert losses(read_metrics(run / "metrics.jsonl")) == losses(
        read_metrics(reference_run / "metrics.jsonl")
    )


def wait_until(ready, job_id: str, workdir: Path, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert time.monotonic() < deadline, job_output(workdir, job_id)
        time.sleep(0.1)


# --- without a cluster ----------------------------------------------------------------------


def job(**changes: object) -> SlurmJob:
    fields = dict(
        min_nodes=2,
        max_nodes=4,
        grace_s=90,
        run_dir=Path("/runs/x"),
        python="/venv/bin/python",
        train_argv=["--training.steps", "100"],
    )
    fields.update(changes)
    return SlurmJob(**fields)


def test_script_for_a_gpu_job_with_a_node_range():
    script = sbatch_script(
        job(gpus_per_node=8, partition="gpu", time="2-00:00:00", account="proj", requeue=True)
    )
    for line in (
        "#SBATCH --nodes=2-4",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --gres=gpu:8",
        "#SBATCH --partition=gpu",
        "#SBATCH --time=2-00:00:00",
        "#SBATCH --account=proj",
        "#SBATCH --signal=B:USR1@90",
        "#SBATCH --requeue",
        "#SBATCH --open-mode=append",
    ):
        assert line in script.splitlines(), line
    # One launcher per node with as many workers as GPUs, sized to the allocation it got.
    assert (
        "/venv/bin/python -m distrain train --nproc 8 --training.steps 100 --run-dir /runs/x"
        in script
    )
    assert '--nnodes "$SLURM_JOB_NUM_NODES"' in script
    assert '--rdzv-endpoint "$head_addr:$port"' in script
    assert 'scontrol show hostnames "$SLURM_JOB_NODELIST"' in script
    assert 'scontrol requeue "$SLURM_JOB_ID"' in script
    assert 'if [ "$rc" -eq 75 ]' in script and EXIT_PREEMPTED == 75
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0


def test_script_for_a_cpu_job_without_requeue():
    script = sbatch_script(job(min_nodes=1, max_nodes=1))
    assert "#SBATCH --nodes=1" in script.splitlines()
    assert "gres" not in script and "--nproc" not in script
    assert "#SBATCH --no-requeue" in script and "scontrol requeue" not in script
    assert '"$run_dir/slurm.sbatch"' in script  # printed as a command (run under bash below)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"time": "1"}, r"--time 1 is not longer than checkpoint.preempt_grace_s \(90 s\)"),
        ({"time": "1:xx"}, r"--time: expected a Slurm time limit"),
        ({"gpus_per_node": -1}, r"--gpus-per-node must be >= 0"),
        ({"train_argv": ["--nnodes", "2"]}, r"--nnodes: `distrain slurm` sets these"),
    ],
)
def test_bad_jobs_are_one_line_errors(changes, message):
    with pytest.raises(ConfigError, match=message):
        sbatch_script(job(**changes))


def test_nodes_and_time_parsing():
    assert parse_nodes("3") == (3, 3) and parse_nodes("2-8") == (2, 8)
    for bad in ("0", "4-2", "two", "1:2"):
        with pytest.raises(ConfigError, match="--nodes"):
            parse_nodes(bad)
    assert parse_time_s("30") == 1800
    assert parse_time_s("30:15") == 1815
    assert parse_time_s("1:00:05") == 3605
    assert parse_time_s("1-2") == 26 * 3600
    assert parse_time_s("1-2:30") == 26 * 3600 + 1800
    assert parse_time_s("1-0:0:9") == 86409


def test_srun_environment_becomes_torch_distributed_variables():
    env = {
        "SLURM_PROCID": "5",
        "SLURM_NTASKS": "8",
        "SLURM_STEP_NUM_TASKS": "6",
        "SLURM_LOCALID": "1",
        "SLURM_NODEID": "2",
        "SLURM_STEP_TASKS_PER_NODE": "2(x2),1,1",
        "SLURM_STEP_NODELIST": "gpu[07-09,12],cpu1",
        "SLURM_JOB_ID": "1234",
        "SLURM_STEP_ID": "3",
    }
    got = srun_task_env(env)
    assert got == {
        "RANK": "5",
        "WORLD_SIZE": "6",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "gpu07",
        "MASTER_PORT": str(20000 + (1234 * 64 + 3) % 20000),
    }
    mine = srun_task_env(dict(env, MASTER_ADDR="10.0.0.1", MASTER_PORT="29500"))
    assert (mine["MASTER_ADDR"], mine["MASTER_PORT"]) == ("10.0.0.1", "29500")
    assert first_host("node5") == "node5" and first_host("a[1-2]-ib,b") == "a1-ib"


def test_slurm_dry_run_prints_the_script_and_writes_nothing(tmp_path, capsys):
    result = cli_in_process(
        capsys,
        "slurm",
        "--nodes",
        "1-2",
        "--dry-run",
        "--",
        "--run-dir",
        str(tmp_path / "run"),
        "--checkpoint.preempt_grace_s",
        "45",
    )
    assert result.returncode == 0, result.stderr
    assert "#SBATCH --signal=B:USR1@45" in result.stdout
    assert not (tmp_path / "run").exists()
    bad = cli_in_process(capsys, "slurm", "--nodes", "3-1", "--dry-run")
    assert bad.returncode == 1
    assert bad.stderr.strip() == "distrain: error: --nodes 3-1: need 1 <= MIN <= MAX"


# --- the script under bash, with hostile strings (no Slurm: stubs on PATH) ------------------


def _stub(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text(f"#!/bin/bash\n{body}\n")
    path.chmod(0o755)


def _run_script(tmp_path: Path, script: str, srun_exit: int) -> subprocess.CompletedProcess:
    """The whole batch script under bash, with srun and scontrol stubbed: srun records its
    arguments (one per line, NUL-separated) and exits `srun_exit`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    _stub(bin_dir, "srun", f'printf "%s\\0" "$@" > {tmp_path}/srun.args\nexit {srun_exit}')
    _stub(bin_dir, "scontrol", f'printf "%s\\0" "$@" > {tmp_path}/scontrol.args\necho node0')
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "SLURM_JOB_ID": "77",
        "SLURM_JOB_NUM_NODES": "1",
        "SLURM_JOB_NODELIST": "node0",
    }
    return subprocess.run(
        ["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
    )


HOSTILE = [
    "with space and 'quotes' and \"double\"",
    "$(touch {marker})",
    "`touch {marker}`",
    "x\ntouch {marker}\n",
    "x\n#SBATCH --uid=0\\$'\\\\'\x01",
    "'; touch {marker}; '",
    '"$(touch {marker})"',
]


@pytest.mark.parametrize("requeue", [False, True])
@pytest.mark.parametrize("hostile", HOSTILE)
def test_hostile_run_dir_runs_nothing_and_stays_one_argument(tmp_path, hostile, requeue):
    marker = tmp_path / "MARKER"
    run_dir = tmp_path / hostile.format(marker=marker)
    script = sbatch_script(
        job(min_nodes=1, max_nodes=1, run_dir=run_dir, requeue=requeue, python=sys.executable)
    )
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
    # Every script line that bash reads as a command, outside the directives, is one we wrote.
    result = _run_script(tmp_path, script, srun_exit=EXIT_PREEMPTED)
    assert not marker.exists(), result.stdout + result.stderr
    assert result.returncode == EXIT_PREEMPTED, result.stderr
    srun_args = (tmp_path / "srun.args").read_text().split("\0")
    assert srun_args[srun_args.index("--run-dir") + 1] == str(run_dir)
    assert f"distrain: run dir {run_dir}: per-rank logs" in result.stdout
    if requeue:
        assert (tmp_path / "scontrol.args").read_text().split("\0")[:2] == ["requeue", "77"]
    else:
        # The resume command, as printed, is one bash word naming the script.
        (line,) = [s for s in result.stdout.splitlines() if "resume with: " in s]
        command = subprocess.run(
            ["bash", "-c", f'printf "%s\\0" {line.split("resume with: ", 1)[1]}'],
            capture_output=True,
            text=True,
        ).stdout
        assert command.split("\0") == ["sbatch", str(run_dir / "slurm.sbatch"), ""]
    assert result.stderr == ""


def test_hostile_run_dir_cannot_leave_the_header_comment():
    script = sbatch_script(job(run_dir=Path("/runs/x\n#SBATCH --uid=0\necho hi")))
    lines = script.splitlines()
    assert "#SBATCH --uid=0" not in lines and "echo hi" not in lines
    # No user string adds a line anywhere: newlines are written as $'\n' escapes.
    assert len(lines) == len(sbatch_script(job()).splitlines())
    # sbatch reads directives up to the first command: only ours come before it.
    header = lines[: next(i for i, line in enumerate(lines) if not line.startswith("#"))]
    assert [line.split()[1].split("=")[0] for line in header[1:] if "SBATCH" in line] == [
        "--job-name",
        "--nodes",
        "--ntasks-per-node",
        "--signal",
        "--no-requeue",
        "--open-mode",
        "--output",
    ]


@pytest.mark.parametrize("option", ["partition", "account", "time"])
@pytest.mark.parametrize("bad", ["gpu\ntouch MARKER #", "gpu\r", "g\x1bpu", "gpu\t"])
def test_control_characters_in_slurm_options_are_refused(option, bad):
    value = bad.replace("gpu", "9:00") if option == "time" else bad
    with pytest.raises(ConfigError, match=rf"^--{option}: .*control character") as refused:
        sbatch_script(job(**{option: value}))
    assert "\n" not in str(refused.value)


def test_partition_and_account_with_quotes_stay_one_directive(tmp_path):
    marker = tmp_path / "MARKER"
    script = sbatch_script(
        job(partition=f"a b'$(touch {marker})", account="`touch x`", python=sys.executable)
    )
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
    lines = script.splitlines()
    assert f"#SBATCH '--partition=a b'\"'\"'$(touch {marker})'" in lines
    assert "#SBATCH '--account=`touch x`'" in lines
    _run_script(tmp_path, script, srun_exit=0)
    assert not marker.exists()
