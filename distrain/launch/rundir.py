"""One run per run directory, and a failed start leaves the directory as it found it.

`RunDirLock` is a lock file, `<run_dir>/run.lock`, holding the holder's host, pid, process start
time, where that pid means something (the kernel's boot id and the pid namespace), torchelastic
job id and Slurm job and start. It is created with `link(2)` of a fully written private file
(a new file of a random name, never a planted symlink's target: distrain/files.py): `link` is
atomic on NFS (unlike `O_EXCL`, which NFSv2 and some servers do not honour), and a reader never
sees a half-written lock. A lost NFS reply is resolved by the private file's link count (2 means
the link was made). A lock is stale, and is taken over, when its holder is a dead
(or recycled) pid in this boot and pid namespace of this host, an earlier attempt of this same
elastic job (whose id `distrain train` makes unique per launch unless --rdzv-id names it), or an
earlier start of this same Slurm job (requeued, maybe onto another first node). A holder on
another host, or on a host of the same name in another boot or pid namespace (containers with
host networking), cannot be checked from here, so the error names it and the file to delete.

`run_id` is the run's identity (`<run_dir>/run_id`), which its checkpoints record so that a
checkpoint location shared by mistake never mixes two runs.

`StartFootprint` notes which run-dir entries exist before a start so that a start that fails
(e.g. `--resume` without a checkpoint) removes only what it created, and puts back the run's
config.toml that the start rewrote.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from distrain.errors import DistrainError
from distrain.files import write_atomic, write_new

LOCK_NAME = "run.lock"
# Set by launchers for their workers, to the lock file's path, when a launcher of the job (node
# 0's) holds the lock.
HELD_BY_LAUNCHER_ENV = "DISTRAIN_RUN_DIR_LOCK"


class RunDirBusy(DistrainError):
    """Another live run holds the run directory."""


def process_start_ticks(pid: int) -> int | None:
    """The start time of `pid` in clock ticks since boot (Linux), or None when unknown; with the
    pid it names one process even after the pid is reused."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # Field 22; the command name (field 2) may hold spaces and parentheses, so count from its end.
    return int(stat.rsplit(")", 1)[1].split()[19])


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def pid_space() -> tuple[str, int]:
    """(boot id, pid namespace inode) of this process: a pid names one process only within
    both. ("", 0) where Linux's /proc does not tell."""
    try:
        boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot_id = ""
    try:
        pid_ns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        pid_ns = 0
    return boot_id, pid_ns


def slurm_start() -> tuple[str, int]:
    """(SLURM_JOB_ID, SLURM_RESTART_COUNT) of this process; ("", 0) outside Slurm. A requeued
    job keeps its id and counts one more start."""
    restarts = os.environ.get("SLURM_RESTART_COUNT", "")
    return os.environ.get("SLURM_JOB_ID", ""), int(restarts) if restarts.isdigit() else 0


@dataclass(frozen=True)
class LockHolder:
    host: str
    pid: int
    start_ticks: int | None
    job: str
    since: str
    # Defaults: a lock written before these fields, whose pid space is unknown (so its pid is
    # not checked) and which no Slurm job owns.
    boot_id: str = ""
    pid_ns: int = 0
    slurm_job: str = ""
    slurm_start: int = 0

    @classmethod
    def me(cls) -> LockHolder:
        pid = os.getpid()
        boot_id, pid_ns = pid_space()
        slurm_job, start = slurm_start()
        return cls(
            host=socket.gethostname(),
            pid=pid,
            start_ticks=process_start_ticks(pid),
            job=_elastic_job(),
            since=time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            boot_id=boot_id,
            pid_ns=pid_ns,
            slurm_job=slurm_job,
            slurm_start=start,
        )

    def stale(self) -> bool:
        """True when this holder is certainly gone (as seen from this process)."""
        if self.job and self.job == _elastic_job():
            # An earlier attempt of this job: the rendezvous runs one attempt at a time, and
            # after a node failure its rank 0 may be elsewhere.
            return True
        if self._earlier_slurm_start():
            return True
        if not self.checkable():
            return False
        if not pid_alive(self.pid):
            return True
        ticks = process_start_ticks(self.pid)
        return ticks is not None and self.start_ticks is not None and ticks != self.start_ticks

    def checkable(self) -> bool:
        """Whether this holder's pid can be looked up from here: same host, boot, namespace."""
        return (self.host, (self.boot_id, self.pid_ns)) == (socket.gethostname(), pid_space())

    def _earlier_slurm_start(self) -> bool:
        """A start of this Slurm job before ours: Slurm ended it before requeueing the job (a
        second step of our own start has the same count, and is alive)."""
        job, start = slurm_start()
        return bool(self.slurm_job) and self.slurm_job == job and self.slurm_start < start

    def where(self) -> str:
        if self.host != socket.gethostname():
            return "on another host"
        return "on this host" if self.checkable() else "in another pid namespace or boot"

    def describe(self) -> str:
        return f"host {self.host} pid {self.pid} (since {self.since})"


def _elastic_job() -> str:
    """torchelastic's run id of this job; '' outside one. torchrun's default id, 'none', is
    shared by unrelated jobs and therefore identifies nothing."""
    job = os.environ.get("TORCHELASTIC_RUN_ID", "")
    return "" if job == "none" else job


class RunDirLock:
    """Exclusive use of a run directory by one run (the launcher of node 0, or rank 0)."""

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_NAME
        self.holder = LockHolder.me()
        self.created_dir = False
        self.held = False

    def acquire(self) -> RunDirLock:
        if self.run_dir.exists() and not self.run_dir.is_dir():
            raise DistrainError(f"run dir {self.run_dir} is a file; choose a directory")
        self.created_dir = not self.run_dir.exists()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        for _ in range(5):
            if _link_new(self.path, self.holder):
                self.held = True
                return self
            holder = _read(self.path)
            if holder is None:  # released meanwhile, or unreadable: try again
                continue
            if not holder.stale():
                raise RunDirBusy(self._busy_message(holder))
            self._take_over(holder)
        raise RunDirBusy(f"run dir {self.run_dir}: could not take {self.path} (contended)")

    def release(self) -> None:
        """Remove the lock if it is still ours, and the run dir if this lock created it and it
        is empty (a failed start)."""
        if self.held and _read(self.path) == self.holder:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
        self.held = False
        if self.created_dir:
            with contextlib.suppress(OSError):
                self.run_dir.rmdir()

    def __enter__(self) -> RunDirLock:
        return self.acquire()

    def __exit__(self, *_exc: object) -> None:
        self.release()

    def _busy_message(self, holder: LockHolder) -> str:
        message = (
            f"run dir {self.run_dir} is in use by another run: {holder.describe()} "
            f"{holder.where()}; wait for it to finish or choose another --run-dir"
        )
        if not holder.checkable():
            message += f" (if no run is left there, delete {self.path})"
        return message

    def _take_over(self, stale: LockHolder) -> None:
        """Remove `stale`'s lock, unless another process replaced it meanwhile. Takeovers are
        serialised by a second lock file, so two starters cannot each remove the other's lock."""
        guard = self.path.with_name(LOCK_NAME + ".takeover")
        if not _link_new(guard, self.holder):
            other = _read(guard)
            if other is not None and other.stale():
                # A starter died mid-takeover: its guard is as dead as the lock it meant to take.
                with contextlib.suppress(FileNotFoundError):
                    guard.unlink()
            time.sleep(0.05)
            return
        try:
            if _read(self.path) == stale:
                self.path.unlink()
        finally:
            with contextlib.suppress(FileNotFoundError):
                guard.unlink()


def _link_new(path: Path, holder: LockHolder) -> bool:
    """Create `path` atomically, holding `holder`; False if it exists."""
    private = path.with_name(f".{path.name}.{holder.host}.{holder.pid}.{uuid.uuid4().hex}")
    write_new(private, json.dumps(asdict(holder)))
    try:
        os.link(private, path)
    except OSError:
        # EEXIST, or an NFS error for a link the server did make: the link count decides.
        pass
    try:
        return os.stat(private).st_nlink == 2
    finally:
        private.unlink()


def _read(path: Path) -> LockHolder | None:
    try:
        return LockHolder(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None


def lock_for_worker(run_dir: Path, rank: int) -> RunDirLock | None:
    """The lock a worker must take: rank 0's, unless a launcher already holds it for us."""
    if rank != 0:
        return None
    if os.environ.get(HELD_BY_LAUNCHER_ENV) == str(Path(run_dir) / LOCK_NAME):
        return None
    return RunDirLock(run_dir).acquire()


class StartFootprint:
    """What a start adds to the run dir, so that a failed start can take it away again."""

    def __init__(self, run_dir: Path, rank: int):
        run_dir = Path(run_dir)
        mine = [run_dir / "logs" / f"rank{rank}.log", run_dir / "heartbeat" / f"rank{rank}.json"]
        if rank == 0:
            mine += [
                run_dir / "config.toml",
                run_dir / "metrics.jsonl",
                run_dir / "tb",
                run_dir / RUN_ID_NAME,
            ]
        self._new = [p for p in mine if not p.exists()]
        self._config = run_dir / "config.toml"
        self._previous_config = (
            self._config.read_bytes() if rank == 0 and self._config.is_file() else None
        )
        # Directories shared by the ranks (the default checkpoint dir, which rank 0 probes before
        # the first step, among them): removed only when empty, by whichever rank is last.
        shared = ("logs", "heartbeat", "flight", "checkpoints")
        self._new_dirs = [d for d in (*(run_dir / n for n in shared), run_dir) if not d.exists()]

    def restore_config(self) -> None:
        """Put back the config.toml this start found (a start that never trained changes
        nothing in the run dir it did not create, whatever ended it)."""
        if self._previous_config is None:
            return
        with contextlib.suppress(OSError):
            if self._config.read_bytes() == self._previous_config:
                return
        write_atomic(self._config, self._previous_config)

    def remove(self) -> None:
        self.restore_config()
        for path in self._new:
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
        for directory in self._new_dirs:
            with contextlib.suppress(OSError):
                directory.rmdir()


RUN_ID_NAME = "run_id"
_RUN_ID = re.compile(r"[0-9a-f]{32}")


def run_id(run_dir: Path, *, create: bool = True) -> str | None:
    """The run's identity, which every checkpoint manifest it commits records: made at the run's
    first start as `<run_dir>/run_id` and read back by every later start in that run dir (a
    resume, an elastic or Slurm restart). Safe for every rank to call at once: the first link
    wins and all read the same id. Without `create` (commands that only read a run folder), a
    run dir without one (made before run ids existed) has None."""
    path = Path(run_dir) / RUN_ID_NAME
    if not path.exists() and not create:
        return None
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        private = path.with_name(f".{RUN_ID_NAME}.{uuid.uuid4().hex}")
        write_new(private, uuid.uuid4().hex + "\n")
        try:
            os.link(private, path)
        except FileExistsError:
            pass  # another rank or start made it first
        finally:
            private.unlink()
    text = path.read_text().strip()
    if not _RUN_ID.fullmatch(text):
        raise DistrainError(
            f"run dir {run_dir}: {RUN_ID_NAME} holds {text[:40]!r}, not a run id (32 hex digits); "
            f"restore it, or delete it to make this a new run"
        )
    return text
