"""Replica groups do not believe the network: attacks on the live-state transport and on a step's
exchange that must fail, in-process (the end-to-end attacks with torchft's own Manager are in
tests/test_replica_attacks.py).

- the live state is fetched only from an address signed for this rank's counterpart, with a
  request MAC bound to the serving group, rank, step and a nonce never used before, and comes
  back encrypted under a key of that request; it is read with `weights_only=True`, then held
  to this rank's exact schema: a peer serving a pickle that calls `os.system` (torchft's default
  transport, or one that speaks distrain's protocol) runs nothing;
- a request for the state without the secret, a captured request sent again, one meant for
  another server, and an address planted by a relay are each refused; a host on the path reads
  only ciphertext;
- each step's slots name every member's group, step and gradient norm under a MAC: a member
  without the secret, outside the configured groups, a second "group 1", a peer at another
  step, and a gradient 1000x the others' are each refused;
- the servers listen on the address they are given, not on every interface;
- the secret file and a remote lighthouse without one are refused in one line.
"""

from __future__ import annotations

import io
import logging
import os
import pickle
import re
import secrets
import socket
import stat
import threading
import urllib.error
import urllib.request
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from helpers import cli_in_process

from distrain.errors import ConfigError
from distrain.ft.network import read_secret, secret_needed
from distrain.ft.transport import AUTH_HEADER, NONCE_HEADER, StateTransport, seal, unseal
from distrain.ft.trust import (
    SLOT_SIZE,
    PeerRefused,
    Round,
    check_slots,
    default_bind,
    mac,
    slots,
)

SECRET = b"0123456789abcdef0123456789abcdef"
TIMEOUT = timedelta(seconds=10)


def _state(step: int = 7) -> dict:
    return {
        "model": {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)},
        "optim": {"w": {"exp_avg": torch.ones(2, 3)}},
        "trainer": {"step": torch.tensor(step)},
    }


def _transport(
    secret: bytes = SECRET,
    *,
    group: int = 0,
    rank: int = 0,
    bind: str = "127.0.0.1",
    timeout: timedelta = TIMEOUT,
) -> StateTransport:
    """A rank's transport: by default rank 0 of group 0 (the serving side in these tests)."""
    return StateTransport(
        bind=bind,
        secret=secret,
        group=group,
        rank=rank,
        timeout=timeout,
        local_state=_state,
        step_of=lambda s: int(s["trainer"]["step"]),
    )


def _staged(state: dict, step: int = 7) -> dict:
    return {"user": {"distrain": state}, "torchft": {"step": step, "batches_committed": 3}}


class _Payload:
    """What an attacker pickles: unpickling it runs a shell command."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture
def pair():
    """Rank 0 of group 0 serving, rank 0 of group 1 (its counterpart) fetching."""
    server, client = _transport(), _transport(group=1)
    yield server, client
    server.shutdown()
    client.shutdown()


def test_the_live_state_round_trips_between_groups_that_share_the_secret(pair):
    _, client = pair
    # The server waits this long for a step it has not staged, then answers 409.
    server = _transport(group=2, timeout=timedelta(seconds=0.5))
    try:
        server.send_checkpoint([1], 7, _staged(_state()), TIMEOUT)
        got = client.recv_checkpoint(0, server.metadata(), 7, TIMEOUT)
        assert got["torchft"] == {"step": 7, "batches_committed": 3}
        assert torch.equal(got["user"]["distrain"]["model"]["w"], _state()["model"]["w"])
        server.disallow_checkpoint()
        with pytest.raises(urllib.error.HTTPError) as error:  # nothing once the step is voted on
            client.recv_checkpoint(0, server.metadata(), 7, TIMEOUT)
        assert error.value.code == 409
    finally:
        server.shutdown()


def test_a_request_without_the_secret_is_not_served_the_weights(pair, caplog):
    server, _ = pair
    server.send_checkpoint([1], 7, _staged(_state()), TIMEOUT)
    intruder = _transport(b"not-the-run-secret-0123456789", group=1)
    try:
        # The intruder cannot even check the address's signature; with it taken as given, the
        # server refuses its request.
        with pytest.raises(PeerRefused, match="not signed with the run secret"):
            intruder.recv_checkpoint(0, server.metadata(), 7, TIMEOUT)
        nonce = "cd" * 32
        forged = mac(b"not-the-run-secret-0123456789", "state-request", 0, 0, 7, nonce).hex()
        with caplog.at_level(logging.WARNING), pytest.raises(urllib.error.HTTPError) as error:
            _get(server, 7, nonce, forged)
        assert error.value.code == 403
    finally:
        intruder.shutdown()
    assert "did not prove the run secret" in caplog.text
    # torchft's own client (its HTTPTransport's URL scheme) gets nothing either.
    with pytest.raises(urllib.error.HTTPError) as error:
        urllib.request.urlopen(f"{_base(server)}checkpoint/7/full", timeout=5)
    assert error.value.code == 403


def _base(transport) -> str:
    """The http://host:port/ of a transport's published (signed) address."""
    return transport.metadata().partition("#")[0]


def _get(server, step: int, nonce: str, auth: str) -> bytes:
    request = urllib.request.Request(
        f"{_base(server)}state/{step}", headers={NONCE_HEADER: nonce, AUTH_HEADER: auth}
    )
    with urllib.request.urlopen(request, timeout=5) as response:
        return response.read()


def _request_auth(step: int, nonce: str, *, group: int = 0, rank: int = 0) -> str:
    return mac(SECRET, "state-request", group, rank, step, nonce).hex()


def test_torchfts_default_transport_serving_a_pickle_runs_nothing(tmp_path):
    """The attack of the review: a peer on torchft's HTTPTransport whose state unpickles to a
    shell command."""
    from torchft.checkpointing.http_transport import HTTPTransport

    marker = tmp_path / "pwned"
    evil = HTTPTransport(timeout=TIMEOUT, num_chunks=0)
    evil.send_checkpoint([0], 7, _staged({"x": _Payload(marker)}), TIMEOUT)
    client = _transport(b"", group=1)
    # The address as the attacker would publish it without a secret to know: signed under b"".
    address = _signed(b"", evil.metadata())
    try:
        with pytest.raises(PeerRefused, match="not a distrain group"):
            client.recv_checkpoint(0, address, 7, TIMEOUT)
    finally:
        client.shutdown()
        evil.shutdown(wait=False)
    assert not marker.exists()


def _signed(secret: bytes, base: str, *, group: int = 0, rank: int = 0) -> str:
    """`base` published as the state address of `group`'s `rank`, signed under `secret`."""
    return f"{base}#{group}.{rank}.{mac(secret, 'state-address', group, rank, base).hex()}"


class _ProtocolSpeakingAttacker:
    """An HTTP server that answers every request for the state with `body`, sealed under the
    secret it knows as group 0's rank 0 (distrain's protocol, as an attacker would write it),
    or with `sealed` as it is (a body recorded elsewhere)."""

    def __init__(self, secret: bytes, body: bytes = b"", *, sealed: bytes | None = None):
        self.secret = secret

        def answer(handler: BaseHTTPRequestHandler) -> None:
            step = int(handler.path.rsplit("/", 1)[1])
            nonce = handler.headers.get(NONCE_HEADER, "")
            out = sealed if sealed is not None else seal(secret, 0, 0, step, nonce, body)
            handler.send_response(200)
            handler.send_header("Content-Length", str(len(out)))
            handler.end_headers()
            handler.wfile.write(out)

        handler = type(
            "Handler",
            (BaseHTTPRequestHandler,),
            {"do_GET": answer, "log_message": lambda *a: None},
        )
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def metadata(self) -> str:
        """Its address, signed under the secret it knows."""
        return _signed(self.secret, f"http://127.0.0.1:{self._server.server_address[1]}/")

    def shutdown(self) -> None:
        self._server.shutdown()
        self._server.server_close()


@pytest.mark.parametrize("secret", [b"", b"an-attacker-guess-0123456789"])
def test_a_pickle_of_objects_in_distrains_protocol_runs_nothing(tmp_path, secret):
    """Without a run secret (a loopback-only run) the attacker can compute the MACs: the
    weights_only loader refuses the pickle. With one, the MAC refuses it before it is read."""
    marker = tmp_path / "pwned"
    evil = _ProtocolSpeakingAttacker(secret, pickle.dumps(_staged({"x": _Payload(marker)})))
    client = _transport(b"" if not secret else SECRET, group=1)
    try:
        expected = "is not data" if not secret else "not signed with the run secret"
        with pytest.raises(PeerRefused, match=expected):
            client.recv_checkpoint(0, evil.metadata(), 7, TIMEOUT)
    finally:
        client.shutdown()
        evil.shutdown()
    assert not marker.exists()


def _served(state: dict, step: int = 7, torchft_step: int = 7) -> bytes:
    buffer = io.BytesIO()
    torch.save(
        {"user": {"distrain": state}, "torchft": {"step": torchft_step, "batches_committed": 0}},
        buffer,
    )
    return buffer.getvalue()


def _with(**changes) -> dict:
    state = _state()
    for path, value in changes.items():
        *parents, leaf = path.split("__")
        node = state
        for key in parents:
            node = node[key]
        if value is None:
            del node[leaf]
        else:
            node[leaf] = value
    return state


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (_served(_with(model__bias=torch.zeros(3))), "keys differ"),
        (_served(_with(optim__w=None)), "keys differ"),
        (_served(_with(model__w=torch.zeros(3, 2))), "float32 (3, 2) from the peer"),
        (_served(_with(model__w=torch.zeros(2, 3, dtype=torch.float64))), "float64"),
        (_served(_with(model__w=[1.0, 2.0])), "a list, not a tensor"),
        (_served(_state(step=1_000_000), torchft_step=1_000_000), "of steps"),
        (_served(_state(), torchft_step=8), "of steps [7, 8]"),
        (b"\0" * (1 << 21), "is over"),
    ],
    ids=["extra", "missing", "shape", "dtype", "not-tensor", "far-ahead", "steps-differ", "size"],
)
def test_a_state_that_is_not_this_ranks_schema_is_refused(body, expected):
    evil = _ProtocolSpeakingAttacker(SECRET, body)
    client = _transport(group=1)
    try:
        with pytest.raises(PeerRefused, match=re.escape(expected)):
            client.recv_checkpoint(0, evil.metadata(), 7, TIMEOUT)
    finally:
        client.shutdown()
        evil.shutdown()


def test_a_response_replayed_for_another_nonce_is_refused(pair):
    """A recorded response (the right body, sealed for an earlier request) does not open."""
    server, client = pair
    server.send_checkpoint([1], 7, _staged(_state()), TIMEOUT)
    nonce = "ab" * 32
    recorded = _get(server, 7, nonce, _request_auth(7, nonce))
    replayer = _ProtocolSpeakingAttacker(SECRET, sealed=recorded)
    try:
        with pytest.raises(PeerRefused, match="did not prove the run secret"):
            client.recv_checkpoint(0, replayer.metadata(), 7, TIMEOUT)
    finally:
        replayer.shutdown()


def test_a_captured_request_sent_again_is_refused(pair):
    """The review's replay: the same request (nonce and MAC) served twice. The second is 403."""
    server, _ = pair
    server.send_checkpoint([1], 7, _staged(_state()), TIMEOUT)
    nonce = "ef" * 32
    _get(server, 7, nonce, _request_auth(7, nonce))
    with pytest.raises(urllib.error.HTTPError) as error:
        _get(server, 7, nonce, _request_auth(7, nonce))
    assert error.value.code == 403


def test_a_request_proven_for_another_rank_is_refused(pair):
    """A request MAC names the rank it is for: one that opens group 0's rank 0 (made as the
    code makes it) is refused by group 2's rank 0 and by group 0's rank 1, which serve too."""
    server, client = pair
    others = [_transport(group=2), _transport(rank=1)]
    try:
        for transport in (server, *others):
            transport.send_checkpoint([1], 7, _staged(_state()), TIMEOUT)
        for other in others:
            nonce = secrets.token_hex(32)
            auth = client._request_mac(0, 0, 7, nonce).hex()
            with pytest.raises(urllib.error.HTTPError) as error:
                _get(other, 7, nonce, auth)
            assert error.value.code == 403
            assert _get(server, 7, nonce, auth)  # the rank it was made for serves it
    finally:
        for other in others:
            other.shutdown()


def test_what_travels_is_ciphertext_a_host_on_the_path_cannot_read(pair):
    """A host between the groups (a relay that forwards the request unchanged, as in the
    review) holds only the sealed body: not torch.save's bytes, no tensor's bytes in it, and it
    opens only under the request's key."""
    server, _ = pair
    state = _state()
    state["model"]["w"] = torch.full((64, 64), 1.2345)  # a run of bytes easy to spot
    server.send_checkpoint([1], 7, _staged(state), TIMEOUT)
    nonce = secrets.token_hex(32)
    sealed = _get(server, 7, nonce, _request_auth(7, nonce))
    plain = state["model"]["w"].numpy().tobytes()
    assert plain[:256] not in sealed and not sealed.startswith(b"PK")
    with pytest.raises(Exception):  # noqa: B017 (any failure to read it will do)
        torch.load(io.BytesIO(sealed), weights_only=True)
    opened = torch.load(io.BytesIO(unseal(SECRET, 0, 0, 7, nonce, sealed)), weights_only=True)
    assert torch.equal(opened["user"]["distrain"]["model"]["w"], state["model"]["w"])


def test_an_address_planted_by_a_relay_is_refused_before_any_request(pair):
    """The review's theft: an intruder overwrote a survivor's published state address (a
    Quorum call to its manager server) with its own relay's. The relay's address carries no
    signature of the run secret (nor can an old one be moved to it), so the rejoining rank
    refuses it and sends the relay nothing."""
    server, client = pair
    server.send_checkpoint([1], 7, _staged(_state()), TIMEOUT)
    seen: list[str] = []

    def relay(handler: BaseHTTPRequestHandler) -> None:
        seen.append(handler.path)
        handler.send_error(502)

    proxy = ThreadingHTTPServer(
        ("127.0.0.1", 0),
        type("Relay", (BaseHTTPRequestHandler,), {"do_GET": relay, "log_message": lambda *a: None}),
    )
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    relay_base = f"http://127.0.0.1:{proxy.server_address[1]}/"
    signature = server.metadata().partition("#")[2]
    try:
        for planted in (relay_base, f"{relay_base}#{signature}", _signed(b"guess", relay_base)):
            with pytest.raises(PeerRefused, match="not signed with the run secret"):
                client.recv_checkpoint(0, planted, 7, TIMEOUT)
        # A genuine address, but of a rank that is not this one's counterpart.
        with pytest.raises(PeerRefused, match="not the counterpart"):
            client.recv_checkpoint(0, _signed(SECRET, relay_base, group=0, rank=1), 7, TIMEOUT)
        with pytest.raises(PeerRefused, match="not the counterpart"):
            client.recv_checkpoint(0, _signed(SECRET, relay_base, group=1), 7, TIMEOUT)
    finally:
        proxy.shutdown()
        proxy.server_close()
    assert seen == []


# --- a step's slots -----------------------------------------------------------------------------


def _exchange(round_: Round, members: list[dict]) -> list[float]:
    """The averaged slots block of an exchange whose members each add theirs (as the all-reduce
    of torchft's manager does: a sum divided by the number of members)."""
    total = sum(slots(round_, **m) for m in members)
    return (total / round_.members).tolist()


def _member(slot: int, group: int, norm: float = 1.0, *, round_: Round | None = None) -> dict:
    return {
        "slot": slot,
        "group": group,
        "grad_norm": torch.tensor(norm),
        "loss": torch.tensor(2.0),
    }


ROUND = Round(secret=SECRET, quorum_id=4, step=123_456, groups=(0, 1, 2), members=3, num_groups=3)


def test_honest_slots_are_believed():
    assert (
        check_slots(
            ROUND, _exchange(ROUND, [_member(i, i, 1 + i / 10) for i in range(3)]), ratio=10
        )
        == ""
    )


def test_a_member_without_the_secret_is_refused():
    forged = Round(**{**ROUND.__dict__, "secret": b"a-guess"})
    averaged = _exchange(ROUND, [_member(0, 0), _member(1, 1)])
    averaged = [a + b for a, b in zip(averaged, _exchange(forged, [_member(2, 2)]), strict=True)]
    assert "slot 2 (calling itself group 2) did not prove the run secret" in check_slots(
        ROUND, averaged, ratio=10
    )
    # A member that leaves its slot empty proves nothing either.
    assert "did not prove" in check_slots(
        ROUND, _exchange(ROUND, [_member(0, 0), _member(1, 1)]), ratio=10
    )


def test_a_slot_replayed_from_an_earlier_quorum_is_refused():
    earlier = Round(**{**ROUND.__dict__, "quorum_id": 3})
    averaged = _exchange(ROUND, [_member(0, 0), _member(1, 1)])
    averaged = [a + b for a, b in zip(averaged, _exchange(earlier, [_member(2, 2)]), strict=True)]
    assert "did not prove the run secret" in check_slots(ROUND, averaged, ratio=10)


@pytest.mark.parametrize(
    ("members", "expected"),
    [
        ([_member(0, 0), _member(1, 1), _member(2, 7)], "group 7 is not one of the"),
        (
            [_member(0, 0), _member(1, 1), _member(2, 1)],
            "two members of the quorum call themselves group 1",
        ),
        ([_member(0, 0), _member(1, 1), _member(2, 2, 1000.0)], "group 2's gradient norm 1000"),
        (
            [_member(0, 0), _member(1, 1), _member(2, 2, float("nan"))],
            "group 2's gradient is not finite",
        ),
    ],
    ids=["unknown-group", "duplicate-group", "huge-gradient", "nan-gradient"],
)
def test_members_outside_the_rules_are_refused(members, expected):
    assert expected in check_slots(ROUND, _exchange(ROUND, members), ratio=10)


def test_a_peer_at_another_step_is_refused():
    ahead = Round(**{**ROUND.__dict__, "step": 1_000_000})
    averaged = _exchange(ROUND, [_member(0, 0), _member(1, 1)])
    averaged = [a + b for a, b in zip(averaged, _exchange(ahead, [_member(2, 2)]), strict=True)]
    assert (
        check_slots(ROUND, averaged, ratio=10)
        == "group 2 is at step 1000000, the quorum at step 123456"
    )


def test_two_groups_with_a_gradient_far_apart_are_refused_and_ratio_0_turns_it_off():
    two = Round(secret=SECRET, quorum_id=1, step=5, groups=(0, 1), members=2, num_groups=2)
    averaged = _exchange(two, [_member(0, 0, 1.0), _member(1, 1, 50.0)])
    assert "group 1's gradient norm 50" in check_slots(two, averaged, ratio=10)
    assert check_slots(two, averaged, ratio=0) == ""
    assert len(averaged) == 2 * SLOT_SIZE


# --- where the servers listen; the secret -------------------------------------------------------


def _other_local_address() -> str | None:
    """An address of this host that is not loopback, if it has one."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("192.0.2.1", 9))  # TEST-NET-1: routes, sends nothing
            address = probe.getsockname()[0]
    except OSError:
        return None
    return None if address.startswith("127.") else address


def test_the_state_server_listens_on_the_bind_address_only():
    assert default_bind("http://127.0.0.1:29510") == "127.0.0.1"
    server = _transport()
    try:
        port = int(_base(server).rsplit(":", 1)[1].strip("/"))
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
        other = _other_local_address()
        if other is not None:
            with pytest.raises(OSError):
                socket.create_connection((other, port), timeout=5).close()
    finally:
        server.shutdown()


def _secret_file(path: Path, content: bytes, mode: int = 0o600) -> str:
    path.write_bytes(content)
    path.chmod(mode)
    return str(path)


def test_the_secret_file_must_be_private_long_and_real(tmp_path):
    good = _secret_file(tmp_path / "secret", SECRET + b"\n")
    assert read_secret(good) == SECRET
    cases = {
        _secret_file(tmp_path / "open", SECRET, 0o644): "is readable by others (mode 644)",
        _secret_file(tmp_path / "short", b"abc"): "holds 3 bytes, fewer than 16",
        str(tmp_path / "nosuch"): "No such file or directory",
    }
    link = tmp_path / "link"
    link.symlink_to(good)
    cases[str(link)] = "is not a regular file"
    for path, expected in cases.items():
        with pytest.raises(ConfigError) as error:
            read_secret(path)
        assert expected in str(error.value) and "fault_tolerance.secret_file" in str(error.value)
    assert stat.S_IMODE(os.stat(good).st_mode) == 0o600


def test_only_a_loopback_lighthouse_goes_without_a_secret():
    assert not secret_needed("http://127.0.0.1:29510")
    assert not secret_needed("http://localhost:29510")
    assert not secret_needed("http://[::1]:29510")
    assert secret_needed("http://10.0.0.5:29510")
    assert secret_needed(f"http://{socket.gethostname()}:29510")


def test_a_remote_lighthouse_without_a_secret_is_refused_before_launch(tmp_path, capsys):
    result = cli_in_process(
        capsys, "train", "--check", "--run-dir", str(tmp_path / "run"),
        "--fault_tolerance.replica_groups", "2", "--parallel.zero_stage", "3",
        "--fault_tolerance.lighthouse", "http://10.0.0.5:29510",
    )  # fmt: skip
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "set fault_tolerance.secret_file" in lines[0], result.stderr
