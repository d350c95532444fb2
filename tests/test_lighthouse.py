"""distrain's lighthouse: torchft's quorum rules (distrain/ft/quorum.py) and its gRPC service,
answered to torchft 0.2.0's own lighthouse client (the Rust one its managers use), plus the
check that tells a dead group from a slow one: a group whose manager server refuses a connection
is left out at once, a group that heartbeats but is slow is waited for.

The replica-group runs (test_replica_groups.py, test_replica_attacks.py, the two-host lab) all
use this lighthouse through `distrain lighthouse`."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from datetime import timedelta

from distrain.ft import lighthouse_wire as wire
from distrain.ft.lighthouse_server import Lighthouse, refuses_connection, serve
from distrain.ft.quorum import QuorumState


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
def _lighthouse(**kw) -> Iterator[str]:
    kw = {"min_replicas": 1, "join_timeout_s": 30.0, "heartbeat_timeout_s": 30.0, "tick_s": 0.01}
    lighthouse = Lighthouse(**kw)
    server, port = serve(lighthouse, "[::]:0")
    try:
        yield f"http://localhost:{port}"
    finally:
        lighthouse.stop()
        server.stop(grace=None)


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
