"""`distrain lighthouse`: the server that forms each step's quorum of replica groups
(ft/replica_groups.py), speaking torchft's lighthouse protocol to torchft's managers
(lighthouse_server.py, quorum.py), and telling a slow group from a gone one.

- **Gone, at once**: a group whose manager server refuses a connection. The lighthouse checks
  the groups a quorum waits for; a killed or crashed process leaves its port closed, so the
  survivors, whose collective with it failed, get their next quorum without waiting.
- **Gone, after `--heartbeat-timeout-ms`**: no heartbeat for that long (each group's manager
  sends one every `HEARTBEAT_INTERVAL_MS` from a thread of its own, which goes on while the
  group computes). This is for what a connection cannot tell: a stopped process, a host that
  vanished. It can be long, since a dead process no longer waits for it.
- **Slow**: heartbeating but not yet at its step boundary. The quorum waits for it up to
  `--join-timeout-s` (default: fault_tolerance.timeout_s's default, the time a collective
  between groups waits for a slow one).

With `--secret-file` (the run's fault_tolerance.secret_file, same rules) only replica ids that
carry a proof of the run secret (each group's, from ft/replica_groups.py) count towards a quorum
or heartbeat; others are refused and logged once. Without it any host that reaches the port
counts: bind it to loopback then.

The quorum is checked every `--tick-ms`. torchft's own lighthouse (`torchft_lighthouse`) speaks
the same protocol and works too, without the first rule: its heartbeat timeout is then both the
wait after every kill and the CPU starvation that evicts a live group.
"""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import sys
import threading

from distrain.config.args import CommandParser
from distrain.errors import DistrainError

HEARTBEAT_INTERVAL_MS = 50
"""How often each group's manager server heartbeats (ft/replica_groups.py passes it)."""
DEFAULT_HEARTBEAT_TIMEOUT_MS = 5000
DEFAULT_JOIN_TIMEOUT_S = 30.0
DEFAULT_TICK_MS = 10


def lighthouse_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="distrain lighthouse",
        description="Run the lighthouse that forms the replica groups' quorum "
        "(fault_tolerance.replica_groups); prints its address, runs until SIGINT or SIGTERM.",
    )
    parser.add_argument(
        "--bind",
        default="[::]:29510",
        help="ADDRESS:PORT to listen on (port 0 = any free port). Bind it to the cluster's "
        "private interface; without --secret-file every host that reaches it can join the "
        "quorum.",
    )
    parser.add_argument(
        "--secret-file",
        default="",
        help="The run secret (the runs' fault_tolerance.secret_file: a regular file of at least "
        "16 bytes, readable by its owner only): only replica groups whose id proves it count "
        "towards a quorum; others are refused and logged once. Give it whenever --bind is not a "
        "loopback address.",
    )
    parser.add_argument(
        "--heartbeat-timeout-ms",
        type=int,
        default=DEFAULT_HEARTBEAT_TIMEOUT_MS,
        help="A group with no heartbeat for this long is gone (a stopped process, a host that "
        "vanished; a process that died is found at once by its refused connection). Groups "
        f"heartbeat every {HEARTBEAT_INTERVAL_MS} ms from a thread of their own.",
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
    from distrain.ft.lighthouse_server import Lighthouse, serve
    from distrain.ft.network import read_secret

    secret = read_secret(ns.secret_file, "--secret-file") if ns.secret_file else b""

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s lighthouse %(levelname)s %(message)s"
    )
    lighthouse = Lighthouse(
        min_replicas=ns.min_groups,
        join_timeout_s=ns.join_timeout_s,
        heartbeat_timeout_s=ns.heartbeat_timeout_ms / 1000,
        tick_s=ns.tick_ms / 1000,
        secret=secret,
    )
    try:
        server, port = serve(lighthouse, ns.bind)
    except (OSError, RuntimeError) as error:
        raise DistrainError(
            f"distrain lighthouse: cannot listen on --bind {ns.bind}: {error}"
        ) from None
    print(f"http://{socket.gethostname()}:{port}", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    lighthouse.stop()
    server.stop(grace=None)
    sys.stdout.flush()
