"""Workers die with their launcher.

torchrun's agent kills its workers when it exits normally or is signalled, but a `kill -9` of the
agent (for `distrain train`, the agent runs inside the launcher process) leaves them training on,
writing to the run dir. A worker therefore asks Linux to SIGKILL it when its parent dies
(`prctl(PR_SET_PDEATHSIG)`); where that call does not exist it polls its parent pid instead.
SIGKILL, not SIGTERM: with the launcher gone there is no one to coordinate a graceful stop with,
and the peers get the same signal at the same moment.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
import threading
import time

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
# Set by the launcher to its own pid, the parent of its workers.
LAUNCHER_PID_ENV = "DISTRAIN_LAUNCHER_PID"
POLL_INTERVAL_S = 1.0


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send `sig` to this process when its parent thread exits; False where
    that is not available (not Linux, or no libc)."""
    if not sys.platform.startswith("linux"):
        return False
    libc_name = ctypes.util.find_library("c")
    if libc_name is None:
        return False
    libc = ctypes.CDLL(libc_name, use_errno=True)
    return libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0) == 0


def watch_parent(parent_pid: int, interval_s: float = POLL_INTERVAL_S) -> threading.Thread:
    """Fallback: a daemon thread that kills this process once it is no longer `parent_pid`'s
    child (a dead parent's children are re-parented to init or a subreaper)."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(interval_s)
        os.kill(os.getpid(), signal.SIGKILL)

    thread = threading.Thread(target=watch, name="distrain-parent-watch", daemon=True)
    thread.start()
    return thread


def die_with_launcher() -> None:
    """Arm the guard in a worker started by torchrun, whose agent starts workers as its direct
    children: under `distrain train` the agent is the launcher, which names itself in the env."""
    parent = int(os.environ.get(LAUNCHER_PID_ENV, os.getppid()))
    if os.getppid() != parent:  # the launcher died before this worker got here
        os.kill(os.getpid(), signal.SIGKILL)
    if not set_parent_death_signal():
        watch_parent(parent)
        return
    # The parent may have died between getppid() and prctl(): then no signal will come.
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGKILL)
