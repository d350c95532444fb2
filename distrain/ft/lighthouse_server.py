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

What any host that reaches the port may send is bounded: a request over `MAX_MESSAGE_BYTES`,
a replica id over `MAX_ID_CHARS`, an address over `MAX_ADDRESS_CHARS` or not http://host:port,
a new id beyond `MAX_IDS` tracked, a quorum request beyond `MAX_PARKED` waiting (or
`MAX_PARKED_PER_PEER` from one connection) is refused at once, logged once (`_Once`); an id
that stops heartbeating is forgotten (`QuorumState.forget`). A quorum request waits on a gRPC
thread, heartbeats are answered at once: with at most `MAX_PARKED` waiting out of `_WORKERS`
threads, heartbeats always find one. With a run secret (`distrain lighthouse --secret-file`)
only replica ids that carry its proof (`trust.proven_group`) are heard at all.
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
from distrain.ft.trust import proven_group

PROBE_INTERVAL_S = 0.1
PROBE_TIMEOUT_S = 0.5
_KEPT = 64
"""Quorums kept for the requests still to wake up and read them."""
_WORKERS = 256
"""gRPC threads: one per quorum request waiting (at most MAX_PARKED), the rest for heartbeats
and refusals."""
MAX_PARKED = 64
"""Quorum requests waiting at once (one per group: fault_tolerance.replica_groups is far less)."""
MAX_PARKED_PER_PEER = 8
"""Quorum requests waiting at once from one connection (a group's manager sends one)."""
MAX_IDS = 256
"""Replica ids tracked at once (heartbeating, waiting or recently gone)."""
MAX_ID_CHARS = 128
MAX_ADDRESS_CHARS = 256
MAX_DATA_CHARS = 4096
MAX_MESSAGE_BYTES = 16384
MAX_LOGGED = 256
"""Distinct refusals logged; later ones are counted, not logged."""

log = logging.getLogger("distrain.lighthouse")


def parse_address(address: str) -> tuple[str, int] | None:
    """(host, port) of a manager server address `http://host:port`, None when it is not one
    (never raises: `http://[::1` and `http://h:99999` are None)."""
    if len(address) > MAX_ADDRESS_CHARS:
        return None
    try:
        parts = urlsplit(address)
        host, port = parts.hostname, parts.port
    except ValueError:
        return None
    if parts.scheme not in ("http", "https") or not host or not port:
        return None
    return host, port


def refuses_connection(address: str, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """True when `address` (http://host:port) answers a TCP connection with a refusal: nothing
    listens there any more. Anything else (accepted, timed out, unresolvable, malformed) is
    False."""
    parsed = parse_address(address)
    if parsed is None:
        return False
    try:
        with socket.create_connection(parsed, timeout=timeout_s):
            return False
    except ConnectionRefusedError:
        return True
    except OSError:
        return False


class _Once:
    """Logs a warning once per key, for at most MAX_LOGGED keys (then counts them)."""

    def __init__(self) -> None:
        self.seen: set[str] = set()
        self.unlogged = 0

    def warn(self, key: str, message: str, *args: object) -> None:
        if key in self.seen:
            return
        if len(self.seen) >= MAX_LOGGED:
            self.unlogged += 1
            if self.unlogged == 1:
                log.warning("further refusals are not logged (%d logged)", MAX_LOGGED)
            return
        self.seen.add(key)
        log.warning(message, *args)


def _short(text: str) -> str:
    return repr(text[:80] + "..." if len(text) > 80 else text)


class Lighthouse:
    """The state, the ticker and the prober; `serve` puts it on a gRPC port. With `secret`
    (the run secret), only replica ids that prove it count (`trust.proven_group`)."""

    def __init__(
        self,
        *,
        min_replicas: int,
        join_timeout_s: float,
        heartbeat_timeout_s: float,
        tick_s: float,
        secret: bytes = b"",
    ):
        self.secret = secret
        self.refused = _Once()
        self._parked: dict[str, int] = {}
        """Quorum requests waiting, by connection (gRPC's peer)."""
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

    def _refuse(self, context: grpc.ServicerContext, code: Any, key: str, why: str) -> None:
        self.refused.warn(key, "refused a request from %s: %s", context.peer(), why)
        context.abort(code, why)

    def _admit(self, replica_id: str, context: grpc.ServicerContext) -> None:
        """Refuse (abort) a request from `replica_id` that may not count: too long, without the
        run's proof, or a new id beyond MAX_IDS (under the lock)."""
        if len(replica_id) > MAX_ID_CHARS:
            self._refuse(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"long:{replica_id[:80]}",
                f"replica id of {len(replica_id)} characters (at most {MAX_ID_CHARS})",
            )
        if self.secret and proven_group(self.secret, replica_id) is None:
            self._refuse(
                context,
                grpc.StatusCode.PERMISSION_DENIED,
                f"proof:{replica_id}",
                f"replica id {_short(replica_id)} carries no proof of the run secret",
            )
        if not self.state.knows(replica_id):
            self.state.forget(time.monotonic())
            self._forget_probes()
            if self.state.tracked() >= MAX_IDS:
                self._refuse(
                    context,
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    "full",
                    f"{MAX_IDS} replica ids tracked already: {_short(replica_id)} not heard",
                )
            log.info("replica id %s heard", replica_id)

    def _forget_probes(self) -> None:
        for rid in [r for r in self._probed if not self.state.knows(r)]:
            del self._probed[rid]

    def quorum(self, request: Any, context: grpc.ServicerContext) -> Any:
        member = request.requester
        with self._lock:
            self._admit(member.replica_id, context)
            for name, value, most in (
                ("address", member.address, MAX_ADDRESS_CHARS),
                ("store_address", member.store_address, MAX_ADDRESS_CHARS),
                ("data", member.data, MAX_DATA_CHARS),
            ):
                if len(value) > most:
                    self._refuse(
                        context,
                        grpc.StatusCode.INVALID_ARGUMENT,
                        f"{name}:{member.replica_id}",
                        f"{name} of {len(value)} characters (at most {most})",
                    )
            if member.address and parse_address(member.address) is None:
                self._refuse(
                    context,
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"address:{member.address}",
                    f"manager address {_short(member.address)} is not http://host:port",
                )
            peer = context.peer()
            if sum(self._parked.values()) >= MAX_PARKED:
                self._refuse(
                    context,
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    "parked",
                    f"{MAX_PARKED} quorum requests waiting already",
                )
            if self._parked.get(peer, 0) >= MAX_PARKED_PER_PEER:
                self._refuse(
                    context,
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"peer:{peer}",
                    f"{MAX_PARKED_PER_PEER} quorum requests from this connection waiting already",
                )
            self._parked[peer] = self._parked.get(peer, 0) + 1
            try:
                return self._wait_for_quorum(member, context)
            finally:
                self._parked[peer] -= 1
                if not self._parked[peer]:
                    del self._parked[peer]

    def _wait_for_quorum(self, member: Any, context: grpc.ServicerContext) -> Any:
        """Under the lock: `member`'s request joined, and the first quorum issued with it."""
        self.state.request(member, time.monotonic())
        seen = self._count
        self._tick()
        try:
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
        except BaseException:
            # Left unanswered (the caller went away): its request no longer waits.
            waiting = self.state.participants.get(member.replica_id)
            if waiting is not None and waiting.member is member:
                del self.state.participants[member.replica_id]
            raise

    def heartbeat(self, request: Any, context: grpc.ServicerContext) -> Any:
        with self._lock:
            self._admit(request.replica_id, context)
            self.state.heartbeat(request.replica_id, time.monotonic())
        return wire.LighthouseHeartbeatResponse()

    # --- the quorum ------------------------------------------------------------------------

    def _tick(self) -> None:
        """Issue the quorum if the rules allow it (under the lock)."""
        members, status = self.state.compute(time.monotonic())
        if status.split(" (")[0] != self._status.split(" (")[0]:
            log.info("quorum status: %s", status)
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
            try:
                self._probe_once()
            except Exception:  # noqa: BLE001 - the prober outlives any one failure
                log.exception("lighthouse prober: a round failed; probing goes on")

    def _probe_once(self) -> None:
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
        gone = {}
        for rid, address in due.items():
            try:
                if refuses_connection(address):
                    gone[rid] = address
            except Exception as error:  # noqa: BLE001 - one bad address stops no other probe
                self.refused.warn(f"probe:{rid}", "probing %s at %r: %s", rid, address, error)
        if not gone:
            return
        with self._lock:
            for rid, address in gone.items():
                log.warning(
                    "replica group %s: its manager server %s refuses connections: gone",
                    rid,
                    address,
                )
                self.state.mark_gone(rid, time.monotonic())
                self._probed.pop(rid, None)
            self._tick()

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            self._lock.notify_all()


def serve(lighthouse: Lighthouse, bind: str) -> tuple[grpc.Server, int]:
    """`lighthouse` on `bind` (host:port; port 0 = any free one): the started server and its
    port."""
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=_WORKERS),
        # Beyond these, gRPC answers RESOURCE_EXHAUSTED itself, before any handler runs.
        maximum_concurrent_rpcs=4 * _WORKERS,
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", 4 * 1024 * 1024),
        ],
    )
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
