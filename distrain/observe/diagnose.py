"""`distrain diagnose RUN_DIR`: what happened to a run, from its files alone (so it works on a run
dir copied off a cluster): per attempt, which rank failed first and with what error (the
traceback's last lines) and which ranks ended without an error (killed from outside), which
rank hung where (hangs.jsonl, written by the watchdog, and the stuck rank's stack dump), the
storage outages the retries rode out (or did not), the damaged checkpoints a resume skipped, the
steps whose update was skipped for non-finite gradients (with the ranks at fault where the logs
name them), how far training got, the changes of membership of replica groups
(fault_tolerance.replica_groups: `replica_lines`, which `distrain status` shows too), the
checkpoint saves and the causes of those that failed (`save_lines`, in `status` too), and the
last committed checkpoint.

Attempts are told apart in each rank's log by the line every worker writes when it starts
("rank R/N on ..."), the first line of each attempt torchrun starts.
"""

from __future__ import annotations

import json
import re
import tomllib
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from distrain.config.io import not_a_run_dir

_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \[rank(\d+)\] (\w+) (.*)$")
_START = re.compile(r"^rank \d+/(\d+) on ")
_DAMAGED = re.compile(r"^checkpoint \S*?(step-\d+ is damaged \(.*\)); skipping it")
_UNREACHABLE = re.compile(r"^storage (\S+) unreachable: ")
_NONFINITE = re.compile(r"^non-finite gradients at step (\d+) on rank\(s\) ([\d, ]+) ")
_REACHABLE = re.compile(r"^storage (\S+) reachable again: .*; unreachable for ([\d.]+) s$")
TRACEBACK_LINES = 8
FAILED_SAVES_SHOWN = 5
MIB = 1 << 20


@dataclass
class Failure:
    rank: int
    time: datetime
    message: str
    traceback: list[str] = field(default_factory=list)


@dataclass
class Outage:
    """Storage a rank could not reach (checkpoint.storage_retry_s): `seconds` is None until the
    rank logged it reachable again."""

    url: str
    rank: int
    seconds: float | None = None

    def line(self) -> str:
        if self.seconds is None:
            return f"storage {self.url} unreachable (rank {self.rank}), not reached again"
        return (
            f"storage {self.url} unreachable for {self.seconds:.1f} s (rank {self.rank}), recovered"
        )


@dataclass
class Attempt:
    world_size: int = 0
    failures: dict[int, Failure] = field(default_factory=dict)
    finished: bool = False
    hang: str | None = None
    damaged: list[str] = field(default_factory=list)
    """Checkpoints this attempt's resume found damaged and skipped (the loader's warnings)."""
    outages: list[Outage] = field(default_factory=list)
    nonfinite_ranks: dict[int, str] = field(default_factory=dict)
    """By step: the ranks whose own gradients were non-finite (known where they stay local)."""


def parse_rank_log(path: Path) -> list[Attempt]:
    """One Attempt per start line in this rank's log, with the first error it logged and the
    traceback lines that follow it."""
    attempts: list[Attempt] = []
    open_failure: Failure | None = None  # unstamped lines after an error are its traceback
    for line in path.read_text(errors="replace").splitlines():
        m = _LINE.match(line)
        if m is None:
            if open_failure is not None and line.strip():
                open_failure.traceback.append(line)
            continue
        open_failure = None
        stamp, rank, level, message = m.groups()
        start = _START.match(message)
        if start or not attempts:
            attempts.append(Attempt(world_size=int(start.group(1)) if start else 0))
            if start:
                continue
        attempt = attempts[-1]
        if message.startswith("finished "):
            attempt.finished = True
        if level == "WARNING" and _DAMAGED.match(message):
            attempt.damaged.append(_DAMAGED.match(message).group(1))
            continue
        if level == "WARNING" and (nonfinite := _NONFINITE.match(message)):
            attempt.nonfinite_ranks[int(nonfinite.group(1))] = nonfinite.group(2)
            continue
        if level == "WARNING" and (down := _UNREACHABLE.match(message)):
            attempt.outages.append(Outage(down.group(1), int(rank)))
            continue
        if level == "WARNING" and (up := _REACHABLE.match(message)):
            url = up.group(1)
            # Several operations (a background save's threads) may retry at once: the
            # recovery closes the oldest outage of that storage still open.
            outage = next((o for o in attempt.outages if o.url == url and o.seconds is None), None)
            if outage is not None:
                outage.seconds = float(up.group(2))
            continue
        if level == "ERROR" and message.startswith("hang: "):
            attempt.hang = attempt.hang or message
            continue
        if level == "ERROR":
            failure = attempt.failures.get(int(rank))
            if failure is None:
                when = datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f")
                failure = attempt.failures[int(rank)] = Failure(int(rank), when, message)
            if not failure.traceback:
                open_failure = failure
    return attempts


def _stack_excerpt(path: Path) -> list[str]:
    """The main thread's innermost frames from a faulthandler dump (the last block)."""
    if not path.exists():
        return []
    blocks = path.read_text(errors="replace").split("\n\n")
    main = next((b for b in reversed(blocks) if "run_training" in b or "<module>" in b), blocks[-1])
    return [line for line in main.splitlines() if line.strip()][:6]


def checkpoint_folder(run_dir: Path) -> Path:
    """Where the run's checkpoints are: checkpoint.dir of its config.toml when that is a local
    folder, else <run_dir>/checkpoints."""
    config = run_dir / "config.toml"
    if config.exists():
        configured = tomllib.loads(config.read_text()).get("checkpoint", {}).get("dir", "")
        if configured and "://" not in configured:
            return Path(configured)
    return run_dir / "checkpoints"


def last_checkpoint(run_dir: Path) -> dict[str, Any] | None:
    """The newest MANIFEST.json (a committed checkpoint) under the run's checkpoint folder."""
    folder = checkpoint_folder(run_dir)
    manifests = []
    for path in folder.glob("*/MANIFEST.json"):
        try:
            manifests.append((json.loads(path.read_text()), path.parent))
        except (OSError, ValueError):
            continue
    if not manifests:
        return None
    manifest, where = max(manifests, key=lambda m: m[0].get("step", -1))
    return {**manifest, "path": str(where)}


def replica_lines(rows: list[dict[str, Any]]) -> list[str]:
    """One line per membership change of the replica groups in a run's metrics rows, and per
    attempt refused because a peer was not believed."""
    lines = []
    for r in rows:
        change = r.get("replica_change")
        if change == "lost":
            lines.append(
                f"  step {r['step']}: lost replica group {r['replica_groups_lost']} (ranks "
                f"{r['ranks_lost']}): {r['cause']}; done by {r['replica_groups']} group(s) in "
                f"{r['recovery_s']:.2f} s, {r['steps_lost']} step(s) lost"
            )
        elif change == "retried":
            lines.append(
                f"  step {r['step']}: redone by every replica group ({r['cause']}; "
                f"{r['recovery_s']:.2f} s), {r['steps_lost']} step(s) lost"
            )
        elif change == "joined":
            lines.append(
                f"  step {r['step']}: replica group {r['replica_groups_joined']} joined "
                f"({r['replica_groups']} group(s))"
            )
        elif change == "rejoined":
            lines.append(
                f"  step {r['step']}: this group rejoined with a peer's live state "
                f"({r['state_mb']:.1f} MiB in {r['transfer_s']:.2f} s)"
            )
        elif change == "refused":
            lines.append(f"  step {r['step']}: refused a peer ({r['reason']})")
    if lines:
        refused = sum(r.get("replica_change") == "refused" for r in rows)
        header = f"replica groups: {len(lines) - refused} membership change(s)"
        lines.insert(0, header + (f", {refused} refused attempt(s)" if refused else ""))
    return lines


def save_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The run's checkpoint saves from its metrics rows: how many settled and failed, what the
    last one cost training (stall) and took to write, and each failed save's cause (the newest
    FAILED_SAVES_SHOWN)."""
    saves = [r for r in rows if "checkpoint_stall_s" in r]
    if not saves:
        return []
    failed = [r for r in saves if r.get("checkpoint_failed")]
    last = saves[-1]
    lines = [
        f"checkpoint saves: {len(saves)}, {len(failed)} failed; last (step {last['step']}): "
        f"training stalled {last['checkpoint_stall_s']:.2f} s, written in "
        f"{last['checkpoint_write_s']:.2f} s, {last['checkpoint_bytes'] / MIB:.1f} MiB"
    ]
    lines += [f"  failed save: {r['checkpoint_error']}" for r in failed[-FAILED_SAVES_SHOWN:]]
    return lines


def nonfinite_lines(trained: list[dict[str, Any]], ranks: dict[int, str]) -> list[str]:
    """The steps whose update was skipped for non-finite gradients (training.nonfinite = skip):
    where a row's running count (nonfinite_skipped) grew; with the ranks at fault where the logs
    name them (`ranks`, by step)."""
    steps, before, previous = [], 0, 0
    for r in trained:
        count, step = r.get("nonfinite_skipped", before), r["step"]
        if count > before:
            # Rows come at logging steps: the skip happened since the previous row (a resume
            # starts the steps again).
            since = previous if previous < step else step - 1
            named = [f"{s} (rank(s) {ranks[s]})" for s in range(since + 1, step + 1) if s in ranks]
            steps += named or [str(step)]
        before, previous = count, step
    if not steps:
        return []
    return [f"non-finite gradients: update skipped at step(s) {', '.join(dict.fromkeys(steps))}"]


def diagnose(run_dir: Path) -> str:
    run_dir = Path(run_dir)
    logs = sorted((run_dir / "logs").glob("rank*.log"))
    if not logs:
        raise not_a_run_dir(run_dir, "logs/rank<N>.log")
    per_rank = {int(p.stem[4:]): parse_rank_log(p) for p in logs}
    hangs = {}  # the watchdog's verdicts by message (each rank also logs the message)
    if (run_dir / "hangs.jsonl").exists():
        for line in (run_dir / "hangs.jsonl").read_text().splitlines():
            row = json.loads(line)
            hangs[row["message"]] = row
    num_attempts = max(len(a) for a in per_rank.values())
    out = [f"run {run_dir}: {len(per_rank)} rank log(s), {num_attempts} attempt(s)"]
    for i in range(num_attempts):
        by_rank = {rank: a[i] for rank, a in per_rank.items() if len(a) > i}
        attempts = list(by_rank.values())
        failures = sorted(
            (f for a in attempts for f in a.failures.values()), key=lambda f: (f.time, f.rank)
        )
        hang = next((a.hang for a in attempts if a.hang), None)
        for damaged in dict.fromkeys(d for a in attempts for d in a.damaged):
            out.append(f"attempt {i}: resume skipped checkpoint {damaged}")
        for _, attempt in sorted(by_rank.items()):
            out += [f"attempt {i}: {outage.line()}" for outage in attempt.outages]
        if hang is not None:
            out.append(f"attempt {i}: {hang}")
            for rank in hangs.get(hang, {}).get("stuck", []):
                excerpt = _stack_excerpt(run_dir / "logs" / f"rank{rank}.stacks")
                if excerpt:
                    out.append(f"  rank {rank} stacks (logs/rank{rank}.stacks):")
                    out += [f"    {line}" for line in excerpt]
        elif failures:
            first = failures[0]
            out.append(
                f"attempt {i}: rank {first.rank} failed first ({first.time:%H:%M:%S.%f}"[:-3]
                + f"): {first.message}"
            )
            out += [f"    {line}" for line in first.traceback[-TRACEBACK_LINES:]]
            others = sorted({f.rank for f in failures[1:]})
            if others:
                out.append(f"  then errors on ranks {', '.join(map(str, others))}")
            silent = [r for r, a in sorted(by_rank.items()) if not a.failures and not a.finished]
            if silent:
                # A rank killed from outside (SIGKILL, the OOM killer, a lost node) logs
                # nothing: the others' errors (a peer's connection reset) are its absence.
                out.append(
                    f"  rank {', '.join(map(str, silent))} ended without an error in its log "
                    "(killed from outside?): the errors above may follow from its loss"
                )
        elif attempts and all(a.finished for a in attempts):
            out.append(f"attempt {i}: finished")
        else:
            out.append(
                f"attempt {i}: ended without an error in the logs (killed, or still running)"
            )
    if num_attempts > 1:
        out.append(f"restarts: {num_attempts - 1}")
    metrics = run_dir / "metrics.jsonl"
    if metrics.exists():
        rows = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
        trained = [r for r in rows if "loss" in r]
        if trained:
            last = trained[-1]
            out.append(f"last logged step {last['step']}: loss {last['loss']:.4f}")
        named = {
            step: ranks
            for attempts in per_rank.values()
            for a in attempts
            for step, ranks in a.nonfinite_ranks.items()
        }
        out += nonfinite_lines(trained, named)
        out += save_lines(rows)
        out += replica_lines(rows)
    checkpoint = last_checkpoint(run_dir)
    if checkpoint is None:
        out.append("no committed checkpoint")
    else:
        out.append(
            f"last committed checkpoint: step {checkpoint['step']} ({checkpoint.get('kind')}, "
            f"world size {checkpoint.get('world_size')}) at {checkpoint['path']}"
        )
    return "\n".join(out)
