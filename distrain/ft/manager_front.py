"""The door of a replica group's manager server: only a process that proves the run secret
reaches torchft's ManagerServer, and what it says on the way can be neither read nor changed.

torchft 0.2.0's ManagerServer (Rust gRPC, in each group's rank 0) answers `Kill` (it exits the
process), `Quorum`, `CheckpointMetadata` and `ShouldCommit` to anyone who connects. This module
owns what stands in front of it and how torchft's clients get through:

- **The front** (`ManagerFront`): torchft's server listens on loopback only; the front listens on
  the group's address (fault_tolerance.bind, at the port torchft asked for) and runs, on each
  connection, a mutual handshake: the front sends a nonce and its group, the client answers with
  its nonce and HMAC-SHA256 under the run secret of (group, both nonces), the front proves the
  secret back the same way (another label), so a client never talks to a front without it.
  Then the bytes are carried both ways as sealed frames (`SealedChannel`: ChaCha20-Poly1305, one
  key per direction derived with HKDF from the secret and both nonces, counter nonces, the frame's
  length as associated data): a host on the path reads nothing, and a frame it injects, changes,
  replays, reorders or cuts ends the connection. A connection that fails is closed and logged in
  one line (once per peer host); the group trains on. One that closes before sending anything
  (the lighthouse's probe, trust-free: it only asks whether the process is there) is not logged.
- **The published address** (`fronted_manager_servers`): torchft's server publishes
  `http://{hostname}:{its own port}` to the lighthouse and to the group's store. It is given the
  hostname `host:FRONT_PORT/`, so what it publishes, `http://host:FRONT_PORT/:PORT`, is the
  front's address (the loopback port after it is a URL path that nothing reads).
- **The clients** (`ManagerTunnels`): every ManagerClient torchft makes (to its own group's rank
  0, and to a recovering source's manager at quorum time) is given, instead of the address, a
  loopback listener of this process (`Tunnel`, one per remote front, reused) that carries each
  connection through the handshake to that front. The client is made only once that front has
  proved the secret: a recovery source the lighthouse names that is not a group of this run (a
  bare torchft manager, another run's) is refused with `PeerRefused` before it is asked
  anything.

Only the rank's own messages to a manager server cross these threads (a few small ones per step,
no tensor): nothing here waits on the device or on a collective.

Without a secret (allowed only with a loopback lighthouse: every group on this host) the MACs and
keys come from the empty string, as in transport.py: they prove nothing.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import socket
import socketserver
import struct
import threading
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from distrain.ft.trust import PeerRefused, mac, same_mac, url_host
from distrain.observe.logs import FILE_ONLY

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
"""Where torchft's manager server listens, behind the front."""
HELLO = b"distrain-manager-front/1"
"""What a front's first bytes start with (then its nonce and its group)."""
NONCE_BYTES = 32
MAC_BYTES = 32
FRAME_BYTES = 1 << 16
"""The most plaintext one sealed frame carries."""
HANDSHAKE_TIMEOUT_S = 10.0
"""How long a connection may take to prove the run secret."""
MAX_HANDSHAKES = 32
"""Connections a front lets prove the secret at once; more are closed at once (and logged)."""
MAX_LOGGED_PEERS = 256
"""Peer hosts a front logs a refusal for; later ones are refused without a line."""
_GROUP = struct.Struct(">Q")
_LENGTH = struct.Struct(">I")
_TAG_BYTES = 16
_AEAD_NONCE_BYTES = 12


class HandshakeFailed(Exception):
    """The other end of a connection did not prove the run secret: what failed, in words."""


class FrameRefused(Exception):
    """A sealed frame did not open under the connection's key: changed, forged, replayed or cut
    on the way."""


# --- the handshake -----------------------------------------------------------------------------


def _proof(secret: bytes, side: str, group: int, server_nonce: bytes, client_nonce: bytes) -> bytes:
    """`side`'s ("client" or "front") proof of the secret for one connection to `group`'s front."""
    return mac(secret, "manager-front", side, group, server_nonce.hex(), client_nonce.hex())


def _keys(
    secret: bytes, group: int, server_nonce: bytes, client_nonce: bytes
) -> tuple[bytes, bytes]:
    """(client-to-front key, front-to-client key) of one connection."""
    material = HKDF(
        algorithm=hashes.SHA256(),
        length=64,
        salt=server_nonce + client_nonce,
        info=f"distrain manager front keys, group {group}".encode(),
    ).derive(secret)
    return material[:32], material[32:]


def _receive(sock: socket.socket, size: int) -> bytes:
    """`size` bytes from `sock`, or fewer where it closed first."""
    data = bytearray()
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            break
        data += chunk
    return bytes(data)


def _opens_with(sock: socket.socket, label: bytes) -> bool:
    """Whether `sock`'s first bytes are `label`: False at the first byte that differs, so a
    server that is not a front (torchft's own opens with HTTP/2 settings) is told at once."""
    data = b""
    while len(data) < len(label):
        chunk = sock.recv(len(label) - len(data))
        data += chunk
        if not chunk or not label.startswith(data):
            return False
    return True


def accept_handshake(sock: socket.socket, secret: bytes, group: int) -> SealedChannel | None:
    """The front's side of the handshake on `sock`: the sealed channel to a client that proved
    `secret`, None when the client closed before sending anything; HandshakeFailed says what
    else went wrong."""
    server_nonce = secrets.token_bytes(NONCE_BYTES)
    sock.sendall(HELLO + server_nonce + _GROUP.pack(group))
    try:
        answer = _receive(sock, NONCE_BYTES + MAC_BYTES)
    except TimeoutError:
        raise HandshakeFailed(f"no handshake within {HANDSHAKE_TIMEOUT_S:g} s") from None
    if not answer:
        return None
    if len(answer) < NONCE_BYTES + MAC_BYTES:
        raise HandshakeFailed(f"it closed after {len(answer)} bytes of the handshake")
    client_nonce, proof = answer[:NONCE_BYTES], answer[NONCE_BYTES:]
    if not same_mac(proof, _proof(secret, "client", group, server_nonce, client_nonce)):
        raise HandshakeFailed("it did not prove the run secret (fault_tolerance.secret_file)")
    sock.sendall(_proof(secret, "front", group, server_nonce, client_nonce))
    to_front, to_client = _keys(secret, group, server_nonce, client_nonce)
    return SealedChannel(sock, send_key=to_client, receive_key=to_front)


def offer_handshake(sock: socket.socket, secret: bytes) -> SealedChannel:
    """The client's side of the handshake on `sock`: the sealed channel to a front that proved
    `secret`; HandshakeFailed says what went wrong."""
    rest = _receive(sock, NONCE_BYTES + _GROUP.size) if _opens_with(sock, HELLO) else b""
    if len(rest) < NONCE_BYTES + _GROUP.size:
        raise HandshakeFailed("it is not a distrain manager front")
    server_nonce = rest[:NONCE_BYTES]
    (group,) = _GROUP.unpack(rest[NONCE_BYTES:])
    client_nonce = secrets.token_bytes(NONCE_BYTES)
    sock.sendall(client_nonce + _proof(secret, "client", group, server_nonce, client_nonce))
    proof = _receive(sock, MAC_BYTES)
    if not same_mac(proof, _proof(secret, "front", group, server_nonce, client_nonce)):
        raise HandshakeFailed(
            "the front and this process do not prove the same run secret "
            "(fault_tolerance.secret_file)"
        )
    to_front, to_client = _keys(secret, group, server_nonce, client_nonce)
    return SealedChannel(sock, send_key=to_front, receive_key=to_client)


# --- the sealed stream -------------------------------------------------------------------------


class SealedChannel:
    """A connection after the handshake: bytes travel as frames of a 4-byte length and the
    ChaCha20-Poly1305 sealing of at most FRAME_BYTES, each direction under its own key, the
    n-th frame under nonce n, the length as associated data."""

    def __init__(self, sock: socket.socket, *, send_key: bytes, receive_key: bytes) -> None:
        self.sock = sock
        self._sealer, self._opener = ChaCha20Poly1305(send_key), ChaCha20Poly1305(receive_key)
        self._sent = self._received = 0

    def send(self, data: bytes) -> None:
        for start in range(0, len(data), FRAME_BYTES):
            chunk = data[start : start + FRAME_BYTES]
            header = _LENGTH.pack(len(chunk) + _TAG_BYTES)
            sealed = self._sealer.encrypt(_counter(self._sent), chunk, header)
            self._sent += 1
            self.sock.sendall(header + sealed)

    def receive(self) -> bytes:
        """The next frame's bytes; b"" once the other end closed between two frames."""
        header = _receive(self.sock, _LENGTH.size)
        if not header:
            return b""
        size = _LENGTH.unpack(header)[0] if len(header) == _LENGTH.size else 0
        if not _TAG_BYTES < size <= FRAME_BYTES + _TAG_BYTES:
            raise FrameRefused(f"a frame header of {header.hex()} is not a sealed frame's")
        sealed = _receive(self.sock, size)
        try:
            data = self._opener.decrypt(_counter(self._received), sealed, header)
        except InvalidTag:
            raise FrameRefused(
                f"frame {self._received} did not open under the connection's key: changed, "
                "forged, replayed or cut on the way"
            ) from None
        self._received += 1
        return data


def _counter(count: int) -> bytes:
    return count.to_bytes(_AEAD_NONCE_BYTES, "big")


def _shut(sock: socket.socket, how: int) -> None:
    """Shut `sock` down (`how`), whatever state it is in: it wakes a thread blocked on it."""
    with contextlib.suppress(OSError):
        sock.shutdown(how)


def _seal_from(plain: socket.socket, channel: SealedChannel) -> None:
    """Carry what `plain` sends into `channel` until `plain` closes."""
    try:
        while data := plain.recv(FRAME_BYTES):
            channel.send(data)
        _shut(channel.sock, socket.SHUT_WR)
    except OSError:
        _shut(plain, socket.SHUT_RDWR)
        _shut(channel.sock, socket.SHUT_RDWR)


def carry(plain: socket.socket, channel: SealedChannel, refused: Callable[[str], None]) -> None:
    """Carry bytes both ways between `plain` (torchft's side, on loopback) and `channel` until
    both are closed, then close them; a frame that does not open is `refused` (with what
    failed) and ends the connection."""
    outbound = threading.Thread(
        target=_seal_from, args=(plain, channel), name="manager-front-out", daemon=True
    )
    outbound.start()
    try:
        while data := channel.receive():
            plain.sendall(data)
        _shut(plain, socket.SHUT_WR)
    except FrameRefused as error:
        refused(str(error))
        _shut(plain, socket.SHUT_RDWR)
        _shut(channel.sock, socket.SHUT_RDWR)
    except OSError:
        _shut(plain, socket.SHUT_RDWR)
        _shut(channel.sock, socket.SHUT_RDWR)
    outbound.join()
    plain.close()
    channel.sock.close()


# --- listening ---------------------------------------------------------------------------------


def _listener(
    host: str, port: int, handle: Callable[[socket.socket, str], None]
) -> socketserver.ThreadingTCPServer:
    """A TCP server bound to (host, port), listening but not yet serving, that hands each
    connection (in a thread of its own) to `handle` with the peer's host."""

    class Handler(socketserver.BaseRequestHandler):
        def handle(self) -> None:
            self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            handle(self.request, self.client_address[0])

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    server_class = type(
        "ManagerFrontListener",
        (socketserver.ThreadingTCPServer,),
        {
            "address_family": family,
            "allow_reuse_address": True,
            "daemon_threads": True,
            "block_on_close": False,
        },
    )
    return server_class((host.strip("[]"), port), Handler)


def _serve(server: socketserver.ThreadingTCPServer, name: str) -> threading.Thread:
    thread = threading.Thread(target=server.serve_forever, name=name, daemon=True)
    thread.start()
    return thread


class ManagerFront:
    """What listens on a group's address in place of torchft's manager server (see the module
    docstring): it carries each connection that proves `secret` for `group` to that server's
    loopback port."""

    def __init__(self, *, bind: str, port: int, secret: bytes, group: int) -> None:
        """Listen on `bind`:`port` (0: any free port, then `self.port`); connections wait in
        the backlog until `start`."""
        self._secret, self._group = secret, group
        self._target = 0
        self._handshakes = threading.BoundedSemaphore(MAX_HANDSHAKES)
        self._refused_from: set[str] = set()
        self._lock = threading.Lock()
        self._server = _listener(bind, port, self._handle)
        self._thread: threading.Thread | None = None
        self.port: int = self._server.server_address[1]

    def start(self, target: int) -> None:
        """Serve, carrying connections to torchft's manager server on loopback port `target`."""
        self._target = target
        self._thread = _serve(self._server, f"manager-front-{self._group}")

    def _handle(self, sock: socket.socket, peer: str) -> None:
        if not self._handshakes.acquire(blocking=False):
            self._refuse(peer, f"over {MAX_HANDSHAKES} connections were handshaking at once")
            return
        try:
            sock.settimeout(HANDSHAKE_TIMEOUT_S)
            channel = accept_handshake(sock, self._secret, self._group)
        except HandshakeFailed as error:
            self._refuse(peer, str(error))
            return
        except OSError:
            return  # the peer went away mid-handshake
        finally:
            self._handshakes.release()
        if channel is None:
            return
        sock.settimeout(None)
        try:
            server = socket.create_connection((LOOPBACK, self._target))
        except OSError:
            return  # torchft's server is shutting down: the client sees its connection closed
        server.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        carry(server, channel, lambda reason: self._refuse(peer, reason))

    def _refuse(self, peer: str, reason: str) -> None:
        """One line for the first refused connection from `peer` (up to MAX_LOGGED_PEERS)."""
        with self._lock:
            if peer in self._refused_from or len(self._refused_from) >= MAX_LOGGED_PEERS:
                return
            self._refused_from.add(peer)
        log.warning(
            "manager front of replica group %d refused a connection from %s: %s; the group "
            "trains on",
            self._group,
            peer,
            reason,
        )

    def shutdown(self) -> None:
        if self._thread is not None:
            self._server.shutdown()
        self._server.server_close()


class FrontedManagerServer:
    """torchft's ManagerServer on loopback with its ManagerFront, as torchft's Manager holds
    one: `address()` is what it publishes (the front's), `shutdown()` ends both."""

    def __init__(self, server: Any, front: ManagerFront) -> None:
        self._server, self._front = server, front

    def address(self) -> str:
        return self._server.address()

    def shutdown(self) -> None:
        self._server.shutdown()
        self._front.shutdown()


@contextlib.contextmanager
def fronted_manager_servers(bind: str, *, secret: bytes, group: int) -> Iterator[None]:
    """While torchft's Manager is built: the ManagerServer it starts (torchft 0.2.0 binds it to
    `[::]`, every interface, with no option to choose) listens on loopback instead, behind a
    ManagerFront on `bind` at the port torchft asked for, and publishes the front's address."""
    import torchft.manager

    original = torchft.manager.ManagerServer

    def fronted(**kwargs: Any) -> FrontedManagerServer:
        port = int(kwargs["bind"].rsplit(":", 1)[1])
        front = ManagerFront(bind=bind, port=port, secret=secret, group=group)
        try:
            server = original(
                **{
                    **kwargs,
                    "bind": f"{LOOPBACK}:0",
                    "hostname": f"{kwargs['hostname']}:{front.port}/",
                }
            )
        except BaseException:
            front.shutdown()
            raise
        address = server.address()
        front.start(int(address.rsplit(":", 1)[1]))
        log.info(
            "replica group %d's manager server answers only through its front at %s",
            group,
            address,
            extra=FILE_ONLY,
        )
        return FrontedManagerServer(server, front)

    torchft.manager.ManagerServer = fronted
    try:
        yield
    finally:
        torchft.manager.ManagerServer = original


# --- the clients -------------------------------------------------------------------------------


class Tunnel:
    """A loopback listener of this process that carries each connection to the manager front
    at `remote` (host, port), once that front proved `secret`."""

    def __init__(self, remote: tuple[str, int], secret: bytes, timeout_s: float) -> None:
        self._remote, self._secret, self._timeout_s = remote, secret, timeout_s
        self._refusal_logged = False
        self._server = _listener(LOOPBACK, 0, self._handle)
        self.address = f"http://{LOOPBACK}:{self._server.server_address[1]}"
        self._thread = _serve(self._server, f"manager-tunnel-{remote[1]}")

    def _connect(self) -> SealedChannel:
        """A sealed channel to the front; HandshakeFailed or OSError when there is none."""
        remote = socket.create_connection(self._remote, timeout=self._timeout_s)
        try:
            remote.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            remote.settimeout(HANDSHAKE_TIMEOUT_S)
            channel = offer_handshake(remote, self._secret)
        except BaseException:
            remote.close()
            raise
        remote.settimeout(None)
        return channel

    def check(self) -> None:
        """Raise PeerRefused unless the front proves the run secret (one handshake). A front
        that cannot be reached is left to torchft's client to report."""
        try:
            self._connect().sock.close()
        except HandshakeFailed as error:
            host, port = self._remote
            raise PeerRefused(
                f"the manager server at {url_host(host)}:{port} is not behind a manager front "
                f"with this run's secret: {error}"
            ) from None
        except OSError:
            pass

    def _handle(self, local: socket.socket, _peer: str) -> None:
        try:
            channel = self._connect()
        except (HandshakeFailed, OSError) as error:
            # torchft's client sees its connection closed, and tells why it needed it.
            self._refused(str(error) or type(error).__name__)
            return
        carry(local, channel, self._refused)

    def _refused(self, reason: str) -> None:
        """One line for the first failed connection through this tunnel."""
        if self._refusal_logged:
            return
        self._refusal_logged = True
        host, port = self._remote
        log.warning("the manager front at %s:%d was not reached: %s", host, port, reason)

    def shutdown(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class ManagerTunnels:
    """While installed, every ManagerClient torchft.manager makes talks to a Tunnel of this
    process instead of its address: one per remote front, made at its first client, reused."""

    def __init__(self, secret: bytes) -> None:
        self._secret = secret
        self._tunnels: dict[tuple[str, int], Tunnel] = {}
        self._lock = threading.Lock()
        self._original: Any = None

    def install(self) -> None:
        import torchft.manager

        self._original = torchft.manager.ManagerClient
        torchft.manager.ManagerClient = self._client

    def _client(self, addr: str, connect_timeout: timedelta) -> Any:
        """torchft's ManagerClient for `addr`, through its tunnel, once the front there proved
        the run secret: else PeerRefused, which torchft reports as the quorum's error (a
        recovery source that is not a group of this run is a refused attempt)."""
        tunnel = self.tunnel_to(addr, connect_timeout.total_seconds())
        tunnel.check()
        return self._original(tunnel.address, connect_timeout=connect_timeout)

    def tunnel_to(self, address: str, timeout_s: float) -> Tunnel:
        """The tunnel to the front at `address` (http://host:port, any path after it)."""
        parts = urlsplit(address)
        if not parts.hostname or parts.port is None:
            raise ValueError(f"manager address {address[:200]!r} is not http://host:port")
        remote = (parts.hostname, parts.port)
        with self._lock:
            if remote not in self._tunnels:
                self._tunnels[remote] = Tunnel(remote, self._secret, timeout_s)
            return self._tunnels[remote]

    def close(self) -> None:
        """Give torchft its own ManagerClient back and stop every tunnel."""
        import torchft.manager

        if self._original is not None:
            torchft.manager.ManagerClient = self._original
        with self._lock:
            tunnels, self._tunnels = list(self._tunnels.values()), {}
        for tunnel in tunnels:
            tunnel.shutdown()
