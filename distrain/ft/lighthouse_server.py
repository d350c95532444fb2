"""The lighthouse server: torchft's `LighthouseService` over gRPC, answered by quorum.py's rules,
with a prober that tells a dead group from a slow one.

- `Quorum`: the caller joins the participants and waits for the first quorum issued with it in
  (a quorum issued without it, it asks again for the next, as torchft's lighthouse does);
- `Heartbeat`: the caller is alive now;
- a ticker checks the rules every tick and issues the quorum when they allow;
- a prober connects to the manager server of each group of a pending quorum (at most every
  `PROBE_INTERVAL_S` each): a refused connection is a process that is gone. A connection that is
  accepted, or that times out (a host that does not answer), says nothing: the heartbeat
  timeout decides.

Each group's manager server (torchft's, in the group's rank 0) is the only client; the messages
are lighthouse_wire.py's.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from concurrent import futures
from typing import Any
from urllib.parse import urlsplit

import grpc

from distrain.ft import lighthouse_wire as wire
from distrain.ft.quorum import QuorumState

PROBE_INTERVAL_S = 0.1
PROBE_TIMEOUT_S = 0.5
_KEPT = 64
"""Quorums kept for the requests still to wake up and read them."""
_WORKERS = 256
"""gRPC threads: one per group waiting in `Quorum`, plus heartbeats."""

log = logging.getLogger("distrain.lighthouse")


def refuses_connection(address: str, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """True when `address` (http://host:port) answers a TCP connection with a refusal: nothing
    listens there any more. Anything else (accepted, timed out, unresolvable) is False."""
    parts = urlsplit(address)
    if not parts.hostname or not parts.port:
        return False
    try:
        with socket.create_connection((parts.hostname, parts.port), timeout=timeout_s):
            return False
    except ConnectionRefusedError:
        return True
    except OSError:
        return False


class Lighthouse:
    """The state, the ticker and the prober; `serve` puts it on a gRPC port."""

    def __init__(
        self,
        *,
        min_replicas: int,
        join_timeout_s: float,
        heartbeat_timeout_s: float,
        tick_s: float,
    ):
        self.state = QuorumState(
            heartbeat_timeout_s=heartbeat_timeout_s,
            join_timeout_s=join_timeout_s,
            min_replicas=min_replicas,
        )
        self.tick_s = tick_s
        self._lock = threading.Condition()
        self._issued: list[Any] = []
        """The latest quorums issued, newest last; `_count` counts every quorum ever issued."""
        self._count = 0
        self._probed: dict[str, float] = {}
        self._stop = threading.Event()
        self._status = ""
        self._threads = [
            threading.Thread(target=self._tick_loop, name="lighthouse-tick", daemon=True),
            threading.Thread(target=self._probe_loop, name="lighthouse-probe", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    # --- gRPC methods ----------------------------------------------------------------------

    def quorum(self, request: Any, context: grpc.ServicerContext) -> Any:
        member = request.requester
        with self._lock:
            self.state.request(member, time.monotonic())
            seen = self._count
            self._tick()
            while True:
                while self._count == seen:
                    if self._stop.is_set() or not context.is_active():
                        context.abort(grpc.StatusCode.CANCELLED, "lighthouse stopping")
                    self._lock.wait(timeout=0.1)
                # Every quorum issued since this request (the newest _KEPT), oldest first.
                since = self._issued[-min(self._count - seen, len(self._issued)) :]
                seen = self._count
                for quorum in since:
                    if any(m.replica_id == member.replica_id for m in quorum.participants):
                        return wire.LighthouseQuorumResponse(quorum=quorum)
                self.state.request(member, time.monotonic())

    def heartbeat(self, request: Any, context: grpc.ServicerContext) -> Any:
        with self._lock:
            self.state.heartbeat(request.replica_id, time.monotonic())
        return wire.LighthouseHeartbeatResponse()

    # --- the quorum ------------------------------------------------------------------------

    def _tick(self) -> None:
        """Issue the quorum if the rules allow it (under the lock)."""
        members, status = self.state.compute(time.monotonic())
        if status != self._status:
            log.debug("quorum status: %s", status)
            self._status = status
        if members is None:
            return
        changed = self.state.issue(members)
        quorum = wire.Quorum(quorum_id=self.state.quorum_id, participants=members)
        quorum.created.GetCurrentTime()
        self._issued.append(quorum)
        del self._issued[:-_KEPT]
        self._count += 1
        if changed:
            ids = ", ".join(m.replica_id for m in members)
            log.info("quorum %d: %s", self.state.quorum_id, ids)
        self._lock.notify_all()

    def _tick_loop(self) -> None:
        while not self._stop.wait(self.tick_s):
            with self._lock:
                self._tick()

    def _probe_loop(self) -> None:
        while not self._stop.wait(self.tick_s):
            now = time.monotonic()
            with self._lock:
                due = {
                    rid: address
                    for rid, address in self.state.to_probe(now).items()
                    if now - self._probed.get(rid, 0.0) >= PROBE_INTERVAL_S
                }
                self._probed.update(dict.fromkeys(due, now))
            # Every due group checked before the quorum is reconsidered: groups that died
            # together leave in one quorum.
            gone = {rid: address for rid, address in due.items() if refuses_connection(address)}
            if not gone:
                continue
            with self._lock:
                for rid, address in gone.items():
                    log.warning(
                        "replica group %s: its manager server %s refuses connections: gone",
                        rid,
                        address,
                    )
                    self.state.mark_gone(rid)
                    self._probed.pop(rid, None)
                self._tick()

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            self._lock.notify_all()


def serve(lighthouse: Lighthouse, bind: str) -> tuple[grpc.Server, int]:
    """`lighthouse` on `bind` (host:port; port 0 = any free one): the started server and its
    port."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=_WORKERS))
    handlers = {
        "Quorum": grpc.unary_unary_rpc_method_handler(
            lighthouse.quorum,
            request_deserializer=wire.LighthouseQuorumRequest.FromString,
            response_serializer=wire.LighthouseQuorumResponse.SerializeToString,
        ),
        "Heartbeat": grpc.unary_unary_rpc_method_handler(
            lighthouse.heartbeat,
            request_deserializer=wire.LighthouseHeartbeatRequest.FromString,
            response_serializer=wire.LighthouseHeartbeatResponse.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(wire.SERVICE, handlers),))
    port = server.add_insecure_port(bind)
    if port == 0:
        raise OSError(f"cannot listen on {bind}")
    server.start()
    return server, port
