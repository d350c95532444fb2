"""distrain's lighthouse: torchft's quorum rules (distrain/ft/quorum.py) and its gRPC service,
answered to torchft 0.2.0's own lighthouse client (the Rust one its managers use), plus the
check that tells a dead group from a slow one: a group whose manager server refuses a connection
is left out at once, a group that heartbeats but is slow is waited for.

The replica-group runs (test_replica_groups.py, test_replica_attacks.py, the two-host lab) all
use this lighthouse through `distrain lighthouse`."""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Iterator
from datetime import timedelta

import grpc

from distrain.ft import lighthouse_server
from distrain.ft import lighthouse_wire as wire
from distrain.ft.lighthouse_server import Lighthouse, refuses_connection, serve
from distrain.ft.quorum import QuorumState
from distrain.ft.trust import proven_group, replica_id

SECRET = b"a run secret of 32 bytes, random"


def _member(rid: str, *, step: int = 0, address: str = "", shrink_only: bool = False):
    return wire.QuorumMember(replica_id=rid, address=address, step=step, shrink_only=shrink_only)


def _state(**kw) -> QuorumState:
    kw = {"heartbeat_timeout_s": 1.0, "join_timeout_s": 10.0, "min_replicas": 1, **kw}
    return QuorumState(**kw)


def _ids(members) -> list[str]:
    return [m.replica_id for m in members]


# --- the rules -----------------------------------------------------------------------------------


def test_a_heartbeating_straggler_is_waited_for_until_the_join_timeout():
    s = _state()
    for rid in ("a", "b", "c"):
        s.heartbeat(rid, 0.0)
    s.request(_member("a"), 0.0)
    s.request(_member("b"), 0.1)
    for rid in ("a", "b", "c"):
        s.heartbeat(rid, 5.0)
    assert s.compute(5.0)[0] is None
    s.request(_member("c"), 5.0)
    assert _ids(s.compute(5.0)[0]) == ["a", "b", "c"]
    # The same wait, with c never coming: issued without it once the join timeout has run.
    s = _state()
    for rid in ("a", "b", "c"):
        s.heartbeat(rid, 0.0)
    s.request(_member("a"), 0.0)
    s.request(_member("b"), 0.0)
    for rid in ("a", "b", "c"):
        s.heartbeat(rid, 9.9)
    assert s.compute(9.9)[0] is None
    assert _ids(s.compute(10.0)[0]) == ["a", "b"]


def test_a_group_without_heartbeat_for_the_timeout_is_left_out():
    s = _state()
    s.heartbeat("c", 0.0)
    s.request(_member("a"), 1.5)
    s.request(_member("b"), 1.5)
    assert _ids(s.compute(1.5)[0]) == ["a", "b"]


def test_fast_quorum_and_shrink_only_follow_torchft():
    s = _state()
    s.request(_member("a"), 0.0)
    s.request(_member("b"), 0.0)
    s.issue(s.compute(0.0)[0])
    assert s.quorum_id == 1 and s.participants == {}
    # A new group heartbeats, the previous members ask again: issued at once, without waiting
    # for the newcomer (it joins the next quorum).
    s.heartbeat("c", 0.1)
    s.request(_member("a", step=1), 0.2)
    s.request(_member("b", step=1), 0.2)
    members, why = s.compute(0.2)
    assert _ids(members) == ["a", "b"] and why.startswith("fast quorum")
    assert not s.issue(members) and s.quorum_id == 1  # same members: same quorum id
    s.request(_member("c"), 0.3)
    s.request(_member("a", step=2, shrink_only=True), 0.3)
    s.request(_member("b", step=2), 0.3)
    assert _ids(s.compute(0.3)[0]) == ["a", "b"]  # shrink only: no newcomer


def test_a_failed_commit_moves_the_quorum_id_with_the_same_members():
    """torchft's rule: a member that reports failed commits (its last step's should_commit said
    no) gets a new quorum id although the membership is the same, so every manager reconfigures
    its process groups instead of reusing the ones the failure may have left broken."""
    s = _state()
    s.request(_member("a"), 0.0)
    s.request(_member("b"), 0.0)
    s.issue(s.compute(0.0)[0])
    assert s.quorum_id == 1
    s.request(_member("a", step=1), 0.1)
    s.request(wire.QuorumMember(replica_id="b", step=1, commit_failures=1), 0.1)
    members, why = s.compute(0.1)
    assert _ids(members) == ["a", "b"] and why.startswith("fast quorum")
    assert not s.issue(members)  # the same members...
    assert s.quorum_id == 2  # ...and yet a new quorum id
    # Commits that succeed again: the id stays.
    s.request(_member("a", step=2), 0.2)
    s.request(_member("b", step=2), 0.2)
    assert not s.issue(s.compute(0.2)[0]) and s.quorum_id == 2


def test_no_quorum_without_a_majority_of_the_heartbeating_groups():
    s = _state(join_timeout_s=0.0)
    for rid in ("a", "b", "c", "d"):
        s.heartbeat(rid, 0.0)
    s.request(_member("a"), 0.0)
    s.request(_member("b"), 0.0)
    assert s.compute(0.0)[0] is None
    s.mark_gone("d")
    assert _ids(s.compute(0.0)[0]) == ["a", "b"]


def test_a_group_gone_is_left_out_at_once_and_groups_are_probed_only_while_a_quorum_waits():
    s = _state()
    for rid, port in (("a", 1), ("b", 2), ("c", 3)):
        s.request(_member(rid, address=f"http://h:{port}"), 0.0)
    s.issue(s.compute(0.0)[0])
    assert s.to_probe(0.1) == {}  # nobody waits
    s.request(_member("a"), 0.1)
    s.request(_member("b"), 0.1)
    # Pending: the straggler and the participants (one may have died after asking).
    assert s.to_probe(0.1) == {"a": "http://h:1", "b": "http://h:2", "c": "http://h:3"}
    assert s.compute(0.1)[0] is None
    s.mark_gone("c")
    assert _ids(s.compute(0.1)[0]) == ["a", "b"]
    s.heartbeat("c", 0.2)  # a late heartbeat of the dead process does not bring it back
    assert "c" not in s.healthy(0.2)


# --- the server, answered to torchft's own client ----------------------------------------------


@contextlib.contextmanager
def _served(**kw) -> Iterator[tuple[str, Lighthouse]]:
    kw = {"min_replicas": 1, "join_timeout_s": 30.0, "heartbeat_timeout_s": 30.0, "tick_s": 0.01,
          **kw}  # fmt: skip
    lighthouse = Lighthouse(**kw)
    server, port = serve(lighthouse, "[::]:0")
    try:
        yield f"http://localhost:{port}", lighthouse
    finally:
        lighthouse.stop()
        server.stop(grace=None)


@contextlib.contextmanager
def _lighthouse(**kw) -> Iterator[str]:
    with _served(**kw) as (address, _):
        yield address


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _quorum_in_thread(client, results: dict, rid: str, address: str, step: int) -> threading.Thread:
    def ask() -> None:
        try:
            results[rid] = client.quorum(
                replica_id=rid, timeout=timedelta(seconds=20), address=address, step=step
            )
        except Exception as error:  # noqa: BLE001 - the assertion reads it
            results[rid] = error

    thread = threading.Thread(target=ask)
    thread.start()
    return thread


def test_torchft_client_gets_its_quorum_and_a_dead_group_is_left_out_at_once():
    """Three groups form a quorum through torchft's client; then group c's manager server is
    gone (its port refuses connections) while it still counts as heartbeating (timeout 30 s,
    join timeout 30 s): a and b get their next quorum within a second, without c."""
    from torchft.coordination import LighthouseClient

    alive = socket.socket()
    alive.bind(("127.0.0.1", 0))
    alive.listen()
    addresses = {
        "a": f"http://127.0.0.1:{alive.getsockname()[1]}",
        "b": f"http://127.0.0.1:{alive.getsockname()[1]}",
        "c": f"http://127.0.0.1:{_closed_port()}",
    }
    with _lighthouse() as address, contextlib.closing(alive):
        client = LighthouseClient(address, timedelta(seconds=5))
        for r in "abc":  # every group's manager heartbeats from its start
            client.heartbeat(r)
        results: dict = {}
        threads = [_quorum_in_thread(client, results, r, addresses[r], 0) for r in "abc"]
        for t in threads:
            t.join(timeout=30)
        assert {r: _ids_of(results[r]) for r in "abc"} == {r: ["a", "b", "c"] for r in "abc"}
        assert results["a"].quorum_id == 1
        client.heartbeat("c")  # c is heartbeating: only the refused connection says it is gone
        start = time.monotonic()
        threads = [_quorum_in_thread(client, results, r, addresses[r], 1) for r in "ab"]
        for t in threads:
            t.join(timeout=30)
        took = time.monotonic() - start
        assert _ids_of(results["a"]) == ["a", "b"] and _ids_of(results["b"]) == ["a", "b"]
        assert results["a"].quorum_id == 2
        assert took < 1.0, took


def test_a_slow_group_whose_server_answers_is_waited_for():
    """The same wait with c's manager server up (slow, not gone): no quorum without it until c
    asks, then one with all three."""
    from torchft.coordination import LighthouseClient

    alive = socket.socket()
    alive.bind(("127.0.0.1", 0))
    alive.listen()
    up = f"http://127.0.0.1:{alive.getsockname()[1]}"
    with _lighthouse() as address, contextlib.closing(alive):
        client = LighthouseClient(address, timedelta(seconds=5))
        for r in "abc":
            client.heartbeat(r)
        results: dict = {}
        threads = [_quorum_in_thread(client, results, r, up, 0) for r in "abc"]
        for t in threads:
            t.join(timeout=30)
        threads = [_quorum_in_thread(client, results, r, up, 1) for r in "ab"]
        for _ in range(10):
            client.heartbeat("c")
            time.sleep(0.1)
        assert all(t.is_alive() for t in threads)  # 1 s later still waiting for c
        threads.append(_quorum_in_thread(client, results, "c", up, 1))
        for t in threads:
            t.join(timeout=30)
        assert [_ids_of(results[r]) for r in "abc"] == [["a", "b", "c"]] * 3


def _ids_of(quorum) -> list[str]:
    assert not isinstance(quorum, Exception), quorum
    return [m.replica_id for m in quorum.participants]


def test_refuses_connection_only_for_a_closed_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        assert not refuses_connection(f"http://127.0.0.1:{s.getsockname()[1]}")
    assert refuses_connection(f"http://127.0.0.1:{_closed_port()}")
    assert not refuses_connection("")  # no address: nothing to say


def test_groups_that_die_together_leave_in_one_quorum_even_after_asking():
    """c asks for the next quorum and then dies, d dies without asking (both still heartbeating
    as far as the timeout knows): a and b get one quorum without both, not one with c first."""
    from torchft.coordination import LighthouseClient

    sockets = {r: socket.socket() for r in "abcd"}
    for s in sockets.values():
        s.bind(("127.0.0.1", 0))
        s.listen()
    addresses = {r: f"http://127.0.0.1:{s.getsockname()[1]}" for r, s in sockets.items()}
    with _lighthouse() as address:
        client = LighthouseClient(address, timedelta(seconds=5))
        for r in "abcd":
            client.heartbeat(r)
        results: dict = {}
        for t in [_quorum_in_thread(client, results, r, addresses[r], 0) for r in "abcd"]:
            t.join(timeout=30)
        assert _ids_of(results["a"]) == list("abcd")

        def ask_then_die() -> None:
            with contextlib.suppress(TimeoutError):  # never answered: c is gone
                client.quorum(
                    replica_id="c", timeout=timedelta(seconds=3), address=addresses["c"], step=1
                )

        asked = threading.Thread(target=ask_then_die)
        asked.start()
        time.sleep(0.3)  # c is a participant of the pending quorum
        for r in "cd":
            sockets[r].close()
            client.heartbeat(r)
        threads = [_quorum_in_thread(client, results, r, addresses[r], 1) for r in "ab"]
        for t in threads:
            t.join(timeout=30)
        asked.join(timeout=10)
        assert _ids_of(results["a"]) == ["a", "b"] and _ids_of(results["b"]) == ["a", "b"]
    for s in sockets.values():
        s.close()


# --- what a host that reaches the lighthouse can do: the attacks that fail ---------------------


class _Raw:
    """A gRPC client of the lighthouse that sends whatever it is given (torchft's client
    checks nothing either)."""

    def __init__(self, address: str):
        self.channel = grpc.insecure_channel(address.removeprefix("http://"))
        self._quorum = self.channel.unary_unary(
            f"/{wire.SERVICE}/Quorum",
            request_serializer=wire.LighthouseQuorumRequest.SerializeToString,
            response_deserializer=wire.LighthouseQuorumResponse.FromString,
        )
        self._heartbeat = self.channel.unary_unary(
            f"/{wire.SERVICE}/Heartbeat",
            request_serializer=wire.LighthouseHeartbeatRequest.SerializeToString,
            response_deserializer=wire.LighthouseHeartbeatResponse.FromString,
        )

    def quorum(self, rid: str, address: str = "", timeout: float = 5.0, future: bool = False):
        request = wire.LighthouseQuorumRequest(requester=_member(rid, address=address))
        call = self._quorum.future if future else self._quorum
        return call(request, timeout=timeout)

    def heartbeat(self, rid: str, timeout: float = 5.0):
        return self._heartbeat(wire.LighthouseHeartbeatRequest(replica_id=rid), timeout=timeout)

    def code(self, call, *args, **kw):
        try:
            call(*args, **kw)
        except grpc.RpcError as error:
            return error.code()
        return grpc.StatusCode.OK


def test_a_malformed_member_address_is_refused_and_no_probe_failure_stops_the_prober(
    monkeypatch,
):
    """`http://[::1` as a member address killed the prober thread for good. It is refused for
    that request; and a probe that raises (whatever the cause) stops no other probe. The quorum
    is held pending (3 groups needed) so that its members are probed, not issued a quorum."""
    with _served(min_replicas=3) as (address, lighthouse):
        raw = _Raw(address)
        for bad in ("http://[::1", "http://h:99999", "ftp://h:1", "x" * 300):
            assert raw.code(raw.quorum, "a", bad) == grpc.StatusCode.INVALID_ARGUMENT, bad
        assert lighthouse.state.participants == {}
        real = lighthouse_server.refuses_connection

        def failing(address: str, *args: object) -> bool:
            if "bad" in address:
                raise ValueError("a probe that fails")
            return real(address, *args)

        monkeypatch.setattr(lighthouse_server, "refuses_connection", failing)
        with lighthouse._lock:  # a group whose probe raises, and a dead one
            lighthouse.state.request(_member("bad", address="http://bad:1"), time.monotonic())
            closed = f"http://127.0.0.1:{_closed_port()}"
            lighthouse.state.request(_member("dead", address=closed), time.monotonic())
        for _ in range(100):
            if "dead" in lighthouse.state.gone:
                break
            time.sleep(0.05)
        assert "dead" in lighthouse.state.gone
        time.sleep(0.3)  # probed again, failing again
        assert lighthouse._threads[1].is_alive()
        raw.channel.close()


def test_a_flood_of_parked_quorum_requests_leaves_heartbeats_served():
    """300 quorum requests that never get a quorum, over 8 connections, starved every honest
    heartbeat (0 of 3 served in 8 s): now at most MAX_PARKED wait, the rest are refused at
    once, and heartbeats are answered."""
    with _served(min_replicas=1000) as (address, lighthouse):
        floods = [_Raw(address) for _ in range(8)]
        calls = [
            floods[i % 8].quorum(f"x{i}", "http://127.0.0.1:1", timeout=20, future=True)
            for i in range(300)
        ]
        time.sleep(1.0)
        honest = _Raw(address)
        start = time.monotonic()
        for rid in "abc":
            honest.heartbeat(rid, timeout=3)
        assert time.monotonic() - start < 3
        refused = [c for c in calls if c.done() and c.code() == grpc.StatusCode.RESOURCE_EXHAUSTED]
        assert len(refused) >= 300 - lighthouse_server.MAX_PARKED
        assert sum(lighthouse._parked.values()) <= lighthouse_server.MAX_PARKED
        assert max(lighthouse._parked.values()) <= lighthouse_server.MAX_PARKED_PER_PEER
        for call in calls:
            call.cancel()
        for client in [*floods, honest]:
            client.channel.close()


def test_ids_without_the_run_secrets_proof_are_not_counted_and_block_no_majority(caplog):
    """3 ids that only heartbeat kept two real groups from any quorum ("no majority"): with the
    run secret the lighthouse hears only ids that prove it; the others are refused, each
    logged once."""
    from torchft.coordination import LighthouseClient

    alive = socket.socket()
    alive.bind(("127.0.0.1", 0))
    alive.listen()
    up = f"http://127.0.0.1:{alive.getsockname()[1]}"
    forged = replica_id(b"another secret, 32 bytes long...", 1) + ":uuid"
    honest = {g: replica_id(SECRET, g) + ":uuid" for g in (0, 1)}
    assert proven_group(SECRET, honest[1]) == 1 and proven_group(SECRET, forged) is None
    tampered = honest[1].replace("group1", "group2")
    caplog.set_level(logging.WARNING, logger="distrain.lighthouse")
    with _served(secret=SECRET) as (address, lighthouse), contextlib.closing(alive):
        raw = _Raw(address)
        for rid in ("x1", "x2", "group3", forged, tampered, "x1"):
            assert raw.code(raw.heartbeat, rid) == grpc.StatusCode.PERMISSION_DENIED
        assert raw.code(raw.quorum, forged, up) == grpc.StatusCode.PERMISSION_DENIED
        assert lighthouse.state.tracked() == 0
        assert sum("x1" in r.getMessage() for r in caplog.records) == 1
        client = LighthouseClient(address, timedelta(seconds=5))
        results: dict = {}
        for rid in honest.values():
            client.heartbeat(rid)
        threads = [_quorum_in_thread(client, results, rid, up, 0) for rid in honest.values()]
        for t in threads:
            t.join(timeout=30)
        assert _ids_of(results[honest[0]]) == sorted(honest.values())
        raw.channel.close()


def test_huge_and_countless_ids_are_refused_and_the_ids_that_go_away_are_forgotten():
    """4 MB replica ids grew the lighthouse from 40 to 638 MB, never freed: a request is at most
    MAX_MESSAGE_BYTES, an id MAX_ID_CHARS, MAX_IDS ids are tracked at once, and an id that
    stopped heartbeating is forgotten."""
    with _served(heartbeat_timeout_s=0.5) as (address, lighthouse):
        raw = _Raw(address)
        assert raw.code(raw.heartbeat, "x" * 4_000_000) == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert raw.code(raw.heartbeat, "x" * 200) == grpc.StatusCode.INVALID_ARGUMENT
        assert lighthouse.state.tracked() == 0
        codes = [raw.code(raw.heartbeat, f"{i:0100d}") for i in range(300)]
        most = lighthouse_server.MAX_IDS
        assert codes.count(grpc.StatusCode.OK) == most
        assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) == 300 - most
        assert lighthouse.state.tracked() == most
        time.sleep(0.6)  # they stop heartbeating: forgotten, their room free again
        assert raw.code(raw.heartbeat, "a") == grpc.StatusCode.OK
        assert lighthouse.state.tracked() == 1 and lighthouse._probed.keys() <= {"a"}
        raw.channel.close()
