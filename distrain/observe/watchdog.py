"""Hang watchdog: a thread per rank that notices when the job stops moving and ends it with a
diagnosis instead of waiting out the collective timeout (gloo's default is 30 minutes, and
torchrun watches only for exits, so a stopped or stuck rank otherwise hangs the job silently).

Every tick (1 s at most) the thread looks at this rank's progress: phase changes, and bytes moved
by checkpoint storage, so that a long save or verification is not a hang but a stalled storage
is. It rewrites the heartbeat file every `HEARTBEAT_EVERY_S` and reads
<run_dir>/heartbeat/hang.json every `ANNOUNCE_POLL_S` (both at most a fifth of the staleness
bound, so that short timeouts keep working). When the progress has not moved for `timeout_s`
nor any other rank's (a rank done with its share of a save waits on those still writing theirs),
or another rank announced a hang, the rank dumps its Python stacks (all threads) to
logs/rank<N>.stacks and its flight record to flight/rank<N>.json, marks its heartbeat, waits
briefly for the others to do the same, and triages: ranks whose heartbeat went stale stopped
responding (SIGSTOP, a dead host); ranks that issued fewer collectives on a group than the others
are stuck before that collective; the rest wait in it. One line says so, and the process leaves
with `HANG_EXIT_CODE` through os._exit — the main thread is blocked in a collective and would
never see an exception — so torchrun's agent restarts the job from the last checkpoint when
--max-restarts allows.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import math
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distrain.files import make_dir, open_append, open_new, write_atomic
from distrain.observe import flight
from distrain.observe.heartbeat import Heartbeat, activate, heartbeat_dir, read_heartbeats

HANG_EXIT_CODE = 124
"""The exit status of a rank the watchdog ended (124, as coreutils' `timeout`)."""

# Announcements older than this process are from an earlier run in the same run dir (attempt
# numbers start at 0 again). Any rank of this job announces only after init_process_group, which
# waited for every process of the job to start.
PROCESS_START = time.time()
# Each heartbeat write is a create and a rename in a shared directory, each hang.json poll an
# open: once a tick each, ~3 metadata operations per second per rank, thousands per second on
# the file server at 1,000 ranks. These bounds make it ~0.17 per rank (2/30 + 1/10). Hangs are
# found no later: the timeout is minutes, and the heartbeats' only readers are the watchdogs.
HEARTBEAT_EVERY_S = 30.0
ANNOUNCE_POLL_S = 10.0


def rank_list(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> "ranks 0-2,5"; [3] -> "rank 3"."""
    ranks = sorted(ranks)
    runs: list[str] = []
    start = prev = ranks[0]
    for r in ranks[1:] + [None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        runs.append(str(start) if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return f"{'rank' if len(ranks) == 1 else 'ranks'} {','.join(runs)}"


def triage(
    beats: dict[int, dict[str, Any]], *, world_size: int, now: float, stale_s: float
) -> dict[str, Any]:
    """Who is stuck and what the others wait in, from this attempt's heartbeats.

    Returns {"stuck": [ranks], "unresponsive": [ranks], "waiting": [ranks], "message": str}."""
    missing = [r for r in range(world_size) if r not in beats]
    unresponsive = sorted(
        r for r, b in beats.items() if not b.get("hang") and now - b["time"] > stale_s
    )
    acting = {r: b for r, b in beats.items() if b.get("hang")}
    # A rank that issued fewer collectives on a group than another member is stuck before the
    # collective the other waits in, unless a rank stopped responding: then all wait on that one
    # (and counts differ for that reason alone: in a gather, the root cannot finish without the
    # stopped rank while the others have sent their part and gone on).
    most: dict[str, int] = {}
    for b in acting.values():
        for group, seq in ((b.get("collective") or {}).get("seqs") or {}).items():
            most[group] = max(most.get(group, 0), seq)
    behind = sorted(
        r
        for r, b in acting.items()
        if not unresponsive
        and any(
            seq < most[group]
            for group, seq in ((b.get("collective") or {}).get("seqs") or {}).items()
        )
    )
    stuck = sorted(set(unresponsive) | set(behind) | set(missing))
    parts = []
    for r in unresponsive:
        b = beats[r]
        parts.append(
            f"rank {r} stopped responding in {b['phase']} of step {b['step']} (no heartbeat for "
            f"{now - b['time']:.0f} s)"
        )
    for r in behind:
        b = beats[r]
        parts.append(
            f"rank {r} stopped in {b['phase']} of step {b['step']} for {b['stalled_s']:.0f} s"
        )
    if missing:
        parts.append(f"{rank_list(missing)} never wrote a heartbeat")
    waiting = sorted(r for r in acting if r not in stuck)
    by_collective: dict[str, list[int]] = {}
    for r in waiting:
        c = acting[r].get("collective")
        where = (
            f"{c['op']} #{c['seq']} (group {c['group_name']})"
            if c
            else f"{acting[r]['phase']} of step {acting[r]['step']}"
        )
        by_collective.setdefault(where, []).append(r)
    waits = "; ".join(f"{rank_list(rs)} wait in {where}" for where, rs in by_collective.items())
    if not parts:
        stalled = max((b.get("stalled_s", 0.0) for b in acting.values()), default=0.0)
        parts.append(f"no rank is behind: all stalled for {stalled:.0f} s")
    message = "hang: " + "; ".join(parts) + (f"; {waits}" if waits else "")
    return {"stuck": stuck, "unresponsive": unresponsive, "waiting": waiting, "message": message}


def others_quiet_s(beats: dict[int, dict[str, Any]], *, rank: int, now: float) -> float:
    """Seconds since a rank other than `rank` last made progress, by their heartbeats (inf: no
    such rank). A heartbeat no longer written still dates its rank's last progress; a rank that
    is done or acting on a hang is not counted."""
    return min(
        (
            now - (b["time"] - b.get("stalled_s", 0.0))
            for r, b in beats.items()
            if r != rank and not b.get("hang") and b.get("phase") != "done"
        ),
        default=math.inf,
    )


def _stopped(pid: int) -> bool:
    """Whether `pid` (on this host) is stopped by a signal (state T in /proc)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] in ("T", "t")


@dataclass
class _Every:
    """Due at most once per `interval_s` of the caller's clock, counted from `last`."""

    interval_s: float
    last: float

    def due(self, now: float) -> bool:
        if now - self.last < self.interval_s:
            return False
        self.last = now
        return True


def start_watchdog(
    run_dir: Path,
    *,
    rank: int,
    world_size: int,
    timeout_s: float,
    logger: logging.Logger,
    nccl: bool,
) -> Watchdog:
    """Create this rank's heartbeat, make it the active one, and start watching it."""
    hb = Heartbeat(run_dir, rank, world_size)
    activate(hb)
    watchdog = Watchdog(hb, run_dir=run_dir, timeout_s=timeout_s, logger=logger, nccl=nccl)
    watchdog.start()
    return watchdog


class Watchdog:
    """The watchdog thread of one rank; `start` after the heartbeat exists, `stop` at the end."""

    def __init__(
        self,
        heartbeat: Heartbeat,
        *,
        run_dir: Path,
        timeout_s: float,
        logger: logging.Logger,
        nccl: bool,
    ):
        self.heartbeat, self.run_dir, self.timeout_s = heartbeat, Path(run_dir), timeout_s
        self.log, self.nccl = logger, nccl
        self.tick_s = min(1.0, timeout_s / 8)
        # A heartbeat older than this is a rank that cannot run even its watchdog thread. Ample
        # against a busy machine delaying the thread by a tick or two.
        self.stale_s = max(2.0, timeout_s / 2)
        # A live rank's heartbeat must look fresh, and a rank must see an announcement while the
        # announcer still waits for the others (`_gather`): both well within stale_s.
        self.write_every_s = min(HEARTBEAT_EVERY_S, self.stale_s / 5)
        self.poll_every_s = min(ANNOUNCE_POLL_S, self.stale_s / 5)
        self.announce_path = heartbeat_dir(run_dir) / "hang.json"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="distrain-watchdog", daemon=True)

    def start(self) -> None:
        self.heartbeat.write(stalled_s=0.0)
        self._thread.start()

    def stop(self) -> None:
        """Stop watching (the run ended); the heartbeat file stays, in phase "done"."""
        self._stop.set()
        self._thread.join()
        self.heartbeat.mark("done")
        self.heartbeat.write(stalled_s=0.0)
        activate(None)

    def _announced(self) -> bool:
        try:
            note = json.loads(self.announce_path.read_text())
        except (OSError, ValueError):
            return False
        return (
            note.get("attempt") == self.heartbeat.attempt and note.get("time", 0) >= PROCESS_START
        )

    def _progress(self) -> tuple[int, int]:
        return self.heartbeat.progress, self.heartbeat.bytes_moved

    def _others_quiet_s(self) -> float:
        beats = read_heartbeats(self.run_dir, attempt=self.heartbeat.attempt)
        return others_quiet_s(beats, rank=self.heartbeat.rank, now=time.time())

    def _loop(self) -> None:
        last, since = self._progress(), time.monotonic()
        write, poll = _Every(self.write_every_s, since), _Every(self.poll_every_s, since)
        while not self._stop.wait(self.tick_s):
            now = time.monotonic()
            if self._progress() != last:
                last, since = self._progress(), now
            stalled = now - since
            if stalled >= self.timeout_s:
                # A rank done with its share of a save or verification waits in a collective on
                # those still moving bytes: it stalled no longer than they did. The heartbeats
                # are read once this rank stalled that long, then not before they could have.
                since = max(since, now - self._others_quiet_s())
                stalled = now - since
            if write.due(now):
                self.heartbeat.write(stalled_s=stalled)
            if stalled >= self.timeout_s or (poll.due(now) and self._announced()):
                try:
                    self._on_hang(stalled)
                except Exception as e:  # said before the exit, which would swallow it
                    self.log.error("watchdog: the hang's triage failed: %s", e)
                finally:
                    # Whatever went wrong in the triage, the job must not go on hanging.
                    os._exit(HANG_EXIT_CODE)

    def _on_hang(self, stalled: float) -> None:
        hb = self.heartbeat
        if not self._announced():
            write_atomic(
                self.announce_path,
                json.dumps({"attempt": hb.attempt, "rank": hb.rank, "time": time.time()}),
            )
        stacks = make_dir(self.run_dir, "logs") / f"rank{hb.rank}.stacks"
        with open_new(stacks) as f:
            f.write(f"rank {hb.rank}, {hb.phase} of step {hb.step}, stalled {stalled:.1f} s\n")
            f.flush()
            faulthandler.dump_traceback(f, all_threads=True)
        collective = flight.dump(self.run_dir, hb.rank, nccl=self.nccl)
        hb.write(stalled_s=stalled, hang=True, collective=collective, stacks=str(stacks))
        beats = self._gather()
        verdict = triage(beats, world_size=hb.world_size, now=time.time(), stale_s=self.stale_s)
        reporter = min(r for r, b in beats.items() if b.get("hang"))
        self.log.error("%s", verdict["message"])
        if reporter == hb.rank:
            if hb.rank != 0:  # rank 0's log already goes to stderr
                print(f"[distrain] {verdict['message']}", file=sys.stderr, flush=True)
            self._record(verdict)
            self._kill_stopped(beats, verdict["unresponsive"])
        else:
            # The first rank to exit makes torchrun stop the others: let the reporter finish.
            self._wait_for_report()
        for handler in self.log.handlers:
            handler.flush()

    def _gather(self) -> dict[int, dict[str, Any]]:
        """This attempt's heartbeats once every responsive rank has dumped (or a grace period
        passed: a rank that cannot act never will)."""
        deadline = time.monotonic() + self.stale_s + 4 * self.tick_s
        while True:
            beats = {
                r: b
                for r, b in read_heartbeats(self.run_dir, attempt=self.heartbeat.attempt).items()
                if b["time"] >= PROCESS_START  # not left over from an earlier run
            }
            now = time.time()
            pending = [
                r for r, b in beats.items() if not b.get("hang") and now - b["time"] <= self.stale_s
            ]
            if not pending or time.monotonic() > deadline:
                return beats
            time.sleep(self.tick_s / 2)

    def _record(self, verdict: dict[str, Any]) -> None:
        """Append the verdict to <run_dir>/hangs.jsonl for `distrain diagnose`."""
        row = {"attempt": self.heartbeat.attempt, "time": time.time(), **verdict}
        with open_append(self.run_dir / "hangs.jsonl") as f:
            f.write(json.dumps(row) + "\n")
        write_atomic(self._reported_path(), str(time.time()))

    def _reported_path(self) -> Path:
        return heartbeat_dir(self.run_dir) / f"reported.{self.heartbeat.attempt}"

    def _reported(self) -> bool:
        try:
            return float(self._reported_path().read_text()) >= PROCESS_START
        except (OSError, ValueError):
            return False

    def _wait_for_report(self) -> None:
        deadline = time.monotonic() + self.stale_s + 2.0
        while not self._reported() and time.monotonic() < deadline:
            time.sleep(self.tick_s / 4)

    def _kill_stopped(self, beats: dict[int, dict[str, Any]], ranks: list[int]) -> None:
        """SIGKILL unresponsive ranks on this host that are stopped by a signal: a stopped
        process cannot act on the agent's SIGTERM, so the restart would otherwise wait out the
        agent's grace period (30 s) before its SIGKILL."""
        host = socket.gethostname()
        for r in ranks:
            b = beats[r]
            if b["host"] == host and _stopped(b["pid"]):
                self.log.error(
                    "watchdog: killing rank %d (pid %d), stopped by a signal", r, b["pid"]
                )
                os.kill(b["pid"], signal.SIGKILL)
