"""`distrain lighthouse`: torchft's lighthouse server with settings that tell a slow replica group
from a gone one.

The lighthouse forms each step's quorum of replica groups (train/replica_groups.py). Whether a
group is alive it decides from the heartbeats each group's manager server sends every
`HEARTBEAT_INTERVAL_MS` from a thread of its own, which goes on while the group computes: a
group in a long step keeps heartbeating, a killed or stopped one stops.

- **Gone** = no heartbeat for `--heartbeat-timeout-ms`. Such a group is left out of the next
  quorum; this timeout is most of the time the survivors wait after a kill.
- **Slow** = heartbeating but not yet at its step boundary. The lighthouse waits for it up to
  `--join-timeout-s` (default: fault_tolerance.timeout_s's default, the time a collective
  between groups waits for a slow one). torchft's own tests start the lighthouse with a join
  timeout of 100 ms; with three or more groups that evicts every group whose step ends later
  than that behind the others' (each eviction a transfer of the live state when it comes
  back).

The quorum is checked every `--tick-ms` (torchft's default, 100 ms, adds up to that to every
recovery). torchft's own log lines stay out of the console unless RUST_LOG asks for them.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

from distrain.config.args import CommandParser
from distrain.errors import DistrainError

HEARTBEAT_INTERVAL_MS = 50
"""How often each group's manager server heartbeats (train/replica_groups.py passes it)."""
DEFAULT_HEARTBEAT_TIMEOUT_MS = 1000
DEFAULT_JOIN_TIMEOUT_S = 30.0
DEFAULT_TICK_MS = 10


def lighthouse_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="distrain lighthouse",
        description="Run the torchft lighthouse that forms the replica groups' quorum "
        "(fault_tolerance.replica_groups); prints its address, runs until SIGINT or SIGTERM.",
    )
    parser.add_argument(
        "--bind",
        default="[::]:29510",
        help="ADDRESS:PORT to listen on (port 0 = any free port). Bind it to the cluster's "
        "private interface: every host that reaches it can join the quorum.",
    )
    parser.add_argument(
        "--heartbeat-timeout-ms",
        type=int,
        default=DEFAULT_HEARTBEAT_TIMEOUT_MS,
        help="A group with no heartbeat for this long is gone: left out of the next quorum. "
        f"Groups heartbeat every {HEARTBEAT_INTERVAL_MS} ms from a thread of their own; raise it "
        "where hosts are so overloaded that a process gets no CPU for this long.",
    )
    parser.add_argument(
        "--join-timeout-s",
        type=float,
        default=DEFAULT_JOIN_TIMEOUT_S,
        help="How long the quorum waits for a heartbeating group that has not reached its step "
        "boundary yet (a slow group); use the run's fault_tolerance.timeout_s.",
    )
    parser.add_argument(
        "--tick-ms", type=int, default=DEFAULT_TICK_MS, help="How often the quorum is checked."
    )
    parser.add_argument(
        "--min-groups",
        type=int,
        default=1,
        help="Fewest replica groups a quorum may have.",
    )
    return parser


def lighthouse_command(argv: list[str]) -> None:
    ns = lighthouse_parser().parse_args(argv)
    for name in ("heartbeat_timeout_ms", "tick_ms", "min_groups"):
        if getattr(ns, name) < 1:
            lighthouse_parser().error(f"--{name.replace('_', '-')} must be at least 1")
    if ns.join_timeout_s <= 0:
        lighthouse_parser().error("--join-timeout-s must be positive")
    os.environ.setdefault("RUST_LOG", "warn")
    try:
        from torchft.coordination import LighthouseServer
    except ImportError:
        raise DistrainError(
            'the lighthouse is torchft\'s: install the ft extra (pip install -e ".[ft]")'
        ) from None

    server = LighthouseServer(
        bind=ns.bind,
        min_replicas=ns.min_groups,
        join_timeout_ms=round(ns.join_timeout_s * 1000),
        quorum_tick_ms=ns.tick_ms,
        heartbeat_timeout_ms=ns.heartbeat_timeout_ms,
    )
    print(server.address(), flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    server.shutdown()
    sys.stdout.flush()
