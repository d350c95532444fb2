"""The manager servers' front (distrain/ft/manager_front.py), in-process and against a real
torchft ManagerServer in a process of its own:

- bytes round-trip through a tunnel and a front that share the secret (many frames, both ways);
- a tunnel with another secret is refused by the front (one line) and reaches nothing behind it,
  and the front proves the secret back (the tunnel refuses a front without it);
- a frame changed or replayed on the way ends the connection (one line), before any of it
  reaches the server behind;
- a connection that closes before sending anything (the lighthouse's probe) is not logged;
- torchft's ManagerServer is started on loopback and publishes the front's address;
- **the attack**: a real gRPC `Kill` and a forged `Quorum`, sent without the secret to the
  address a fronted ManagerServer publishes, are refused and the process lives on; the same
  `Kill` through a tunnel with the secret does end it (so the refused call was a live one).
"""

from __future__ import annotations

import logging
import os
import socket
import socketserver
import subprocess
import sys
import threading
import time
from urllib.parse import urlsplit

import grpc
import pytest

from distrain.ft.manager_front import (
    LOOPBACK,
    ManagerFront,
    ManagerTunnels,
    fronted_manager_servers,
    offer_handshake,
)
from distrain.ft.trust import PeerRefused

SECRET = b"0123456789abcdef0123456789abcdef"
REFUSED = "manager front of replica group 3 refused a connection from 127.0.0.1"


class _Echo(socketserver.ThreadingTCPServer):
    """What stands behind the front in these tests: sends back what it gets; counts
    connections."""

    daemon_threads = True

    def __init__(self) -> None:
        self.connections = 0
        echo = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                echo.connections += 1
                while data := self.request.recv(1 << 16):
                    self.request.sendall(data)

        super().__init__((LOOPBACK, 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()


@pytest.fixture
def front():
    """Group 3's front on 127.0.0.1 before an echo server; yields (front, echo)."""
    echo = _Echo()
    door = ManagerFront(bind=LOOPBACK, port=0, secret=SECRET, group=3)
    door.start(echo.server_address[1])
    yield door, echo
    door.shutdown()
    echo.shutdown()


def _through(tunnels: ManagerTunnels, door: ManagerFront) -> socket.socket:
    """A connection to `door` through `tunnels` (a published address: the path is ignored)."""
    tunnel = tunnels.tunnel_to(f"http://{LOOPBACK}:{door.port}/:1", 5)
    host, port = urlsplit(tunnel.address).hostname, urlsplit(tunnel.address).port
    return socket.create_connection((host, port), timeout=10)


def _receive_all(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size and (chunk := sock.recv(1 << 16)):
        data += chunk
    return data


def _refusals(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "refused a connection" in r.getMessage()]


def test_bytes_round_trip_through_a_tunnel_and_a_front_with_the_secret(front, caplog):
    door, echo = front
    tunnels = ManagerTunnels(SECRET)
    payload = os.urandom(300_000)  # several frames
    try:
        with _through(tunnels, door) as sock:
            sock.sendall(payload)
            assert _receive_all(sock, len(payload)) == payload
        with _through(tunnels, door) as sock:  # the same tunnel, a second connection
            sock.sendall(b"again")
            assert _receive_all(sock, 5) == b"again"
        assert len(tunnels._tunnels) == 1 and echo.connections == 2
    finally:
        tunnels.close()
    assert not _refusals(caplog)


def test_a_tunnel_without_the_secret_is_refused_and_reaches_nothing(front, caplog):
    door, echo = front
    caplog.set_level(logging.WARNING)
    tunnels = ManagerTunnels(b"another secret, 32 bytes long...")
    try:
        for _ in range(2):
            with _through(tunnels, door) as sock:
                sock.sendall(b"\n\x05pwned")
                assert _receive_all(sock, 1) == b""
    finally:
        tunnels.close()
    time.sleep(0.2)
    assert echo.connections == 0
    refusals = _refusals(caplog)
    assert len(refusals) == 1, refusals  # one line per host
    assert refusals[0].startswith(REFUSED) and "did not prove the run secret" in refusals[0]
    tunnel_lines = [r.getMessage() for r in caplog.records if "was not reached" in r.getMessage()]
    assert len(tunnel_lines) == 1 and "do not prove the same run secret" in tunnel_lines[0]
    with pytest.raises(PeerRefused, match="is not behind a manager front with this run's secret"):
        ManagerTunnels(b"another secret, 32 bytes long...").tunnel_to(
            f"http://{LOOPBACK}:{door.port}", 5
        ).check()
    ManagerTunnels(SECRET).tunnel_to(f"http://{LOOPBACK}:{door.port}", 5).check()


def test_a_server_that_is_no_front_is_refused_at_its_first_bytes():
    """torchft's own manager server opens with an HTTP/2 SETTINGS frame: a client is never
    made for it."""

    class Settings(socketserver.BaseRequestHandler):
        def handle(self) -> None:
            self.request.sendall(bytes.fromhex("000012040000000000000400100000000500004000"))
            self.request.recv(1)

    server = socketserver.ThreadingTCPServer((LOOPBACK, 0), Settings)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        started = time.monotonic()
        tunnel = ManagerTunnels(SECRET).tunnel_to(
            f"http://{LOOPBACK}:{server.server_address[1]}", 5
        )
        with pytest.raises(PeerRefused, match="it is not a distrain manager front"):
            tunnel.check()
        assert time.monotonic() - started < 3
    finally:
        server.shutdown()
        server.server_close()


class _Recorder:
    """Stands in for a channel's socket: keeps what would be sent."""

    def __init__(self) -> None:
        self.sent = b""

    def sendall(self, data: bytes) -> None:
        self.sent += data


def _sealed(channel, data: bytes) -> bytes:
    """The bytes `channel` would send for `data` (its frame counter moves on)."""
    sock, channel.sock = channel.sock, _Recorder()
    channel.send(data)
    sealed, channel.sock = channel.sock.sent, sock
    return sealed


@pytest.mark.parametrize("attack", ["changed", "replayed"])
def test_a_frame_changed_or_replayed_on_the_way_ends_the_connection(front, caplog, attack):
    door, echo = front
    caplog.set_level(logging.WARNING)
    with socket.create_connection((LOOPBACK, door.port), timeout=10) as sock:
        channel = offer_handshake(sock, SECRET)
        first = _sealed(channel, b"ping")
        sock.sendall(first)
        assert channel.receive() == b"ping"
        if attack == "changed":
            frame = bytearray(_sealed(channel, b"Kill"))
            frame[-1] ^= 1
            sock.sendall(bytes(frame))
        else:
            sock.sendall(first)
        try:
            answer = channel.receive()
        except OSError:  # reset rather than closed
            answer = b""
        assert answer == b""  # nothing came back from the echo server: the frame never reached it
    time.sleep(0.2)
    refusals = _refusals(caplog)
    assert len(refusals) == 1 and "frame 1 did not open" in refusals[0], refusals


def test_a_connection_closed_before_a_byte_is_not_logged(front, caplog):
    door, _ = front
    caplog.set_level(logging.WARNING)
    for _ in range(3):
        socket.create_connection((LOOPBACK, door.port), timeout=5).close()
    time.sleep(0.2)
    assert not _refusals(caplog)


def test_torchfts_server_listens_on_loopback_and_publishes_the_front(monkeypatch):
    """torchft 0.2.0 asks for `[::]` (every interface): its server gets loopback, and the
    hostname that makes its published address the front's."""
    import torchft.manager

    seen = []

    class Server:
        def __init__(self, **kwargs):
            seen.append(kwargs)

        def address(self):
            return f"http://{seen[-1]['hostname']}:4242"

        def shutdown(self):
            pass

    monkeypatch.setattr(torchft.manager, "ManagerServer", Server)
    with fronted_manager_servers(LOOPBACK, secret=SECRET, group=0):
        fronted = torchft.manager.ManagerServer(bind="[::]:0", hostname="here")
    try:
        (kwargs,) = seen
        assert kwargs["bind"] == f"{LOOPBACK}:0"
        front_port = int(kwargs["hostname"].split(":")[1].rstrip("/"))
        assert fronted.address() == f"http://here:{front_port}/:4242"
        assert urlsplit(fronted.address()).port == front_port
        with socket.create_connection((LOOPBACK, front_port), timeout=5) as sock:
            assert sock.recv(8) == b"distrain"  # the front's hello, not torchft's server
    finally:
        fronted.shutdown()
    assert torchft.manager.ManagerServer is Server


FRONTED_SERVER = """
import logging, sys, time
from datetime import timedelta

import torchft.manager
from torchft._torchft import LighthouseServer

from distrain.ft.manager_front import fronted_manager_servers

logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1)
with fronted_manager_servers("127.0.0.1", secret=sys.argv[1].encode(), group=3):
    server = torchft.manager.ManagerServer(
        replica_id="group3",
        lighthouse_addr=lighthouse.address(),
        hostname="127.0.0.1",
        bind="[::]:0",
        store_addr="127.0.0.1:1",
        world_size=1,
        heartbeat_interval=timedelta(milliseconds=100),
        connect_timeout=timedelta(seconds=10),
        quorum_retries=0,
    )
print(server.address(), flush=True)
time.sleep(120)
"""

KILL = b"\n\x05pwned"  # torchft.KillRequest{msg: "pwned"}
QUORUM = b"\x08\x00\x10\x05"  # torchft.ManagerQuorumRequest{group_rank: 0, step: 5}


def _call(target: str, method: str, request: bytes) -> None:
    """One unary gRPC call of torchft's ManagerService at `target` (host:port)."""
    with grpc.insecure_channel(target) as channel:
        channel.unary_unary(f"/torchft.ManagerService/{method}")(request, timeout=5)


def test_a_kill_without_the_secret_to_the_published_address_ends_nothing():
    server = subprocess.Popen(
        [sys.executable, "-c", FRONTED_SERVER, SECRET.decode()],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, RUST_LOG="error"),
    )
    tunnels = ManagerTunnels(SECRET)
    try:
        published = server.stdout.readline().strip()
        target = urlsplit(published).netloc
        for method, request in (("Kill", KILL), ("Quorum", QUORUM)):
            with pytest.raises(grpc.RpcError) as error:
                _call(target, method, request)
            assert error.value.code() == grpc.StatusCode.UNAVAILABLE, error.value
        time.sleep(1)
        assert server.poll() is None, "a Kill without the secret ended the manager's process"
        # The control: the same call with the secret, through a tunnel, is torchft's Kill.
        tunnel = tunnels.tunnel_to(published, 5)
        with pytest.raises(grpc.RpcError):
            _call(urlsplit(tunnel.address).netloc, "Kill", KILL)
        assert server.wait(timeout=30) == 1
    finally:
        tunnels.close()
        if server.poll() is None:
            server.kill()
        _, err = server.communicate()
    refusals = [line for line in err.splitlines() if "refused a connection from" in line]
    assert len(refusals) == 1, err[-3000:]
    assert REFUSED in refusals[0], refusals
