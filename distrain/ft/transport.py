"""The live state a rejoining replica group fetches from a peer: data only, authenticated,
confidential, and bound to the rank that serves it.

torchft's default transport (HTTPTransport) serves a pickle of the state and loads the peer's
with `weights_only=False`: any host that joins the quorum at a higher step makes the others run
its code. This transport replaces it (torchft's `CheckpointTransport` interface):

- **The address** a rank publishes (torchft hands it to the peer through its manager servers,
  which anyone can call) is signed: `http://host:port/#<group>.<rank>.<HMAC(secret, group,
  rank, address)>`. A fetching rank believes only an address signed for its counterpart (the
  same rank of another group), so an address an intruder planted in a manager server (a relay
  of its own) is refused before any request is sent.
- **Served**: the state is staged once per `send_checkpoint` as `torch.save` bytes of nested
  dicts of CPU tensors and integers, on an HTTP server bound to one address
  (`fault_tolerance.bind`), at `/state/<step>`. A request must carry a nonce never used before
  (the last `NONCES_KEPT` are remembered) and HMAC(secret, group, rank, step, nonce) of this
  server's own group and rank; anything else is refused (403) and logged once per address.
- **The body** is encrypted and authenticated (ChaCha20-Poly1305, the `cryptography` library)
  under a key of that request alone, HMAC(secret, group, rank, step, nonce), with the group,
  rank, step and nonce as associated data: a host between the two groups reads nothing, and a
  body recorded for one request does not open for another.
- **Fetched**: the response must open under the request's key and be no larger than the local
  state plus a margin; only then is it read, with `torch.load(weights_only=True)`, and believed
  only if its keys, dtypes and shapes are exactly this rank's own state's and its steps are the
  quorum's.

A refusal raises `PeerRefused`: torchft records the error, no group commits the step, and
`ReplicaGroups` stops the run after a few refusals in a row (replica_groups.py).
"""

from __future__ import annotations

import io
import logging
import secrets
import socket
import threading
import urllib.error
import urllib.request
from collections import OrderedDict
from collections.abc import Callable
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

import torch
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from torchft.checkpointing.transport import CheckpointTransport

from distrain.ft.trust import PeerRefused, mac, same_mac, url_host

log = logging.getLogger(__name__)

AUTH_HEADER = "X-Distrain-Auth"
NONCE_HEADER = "X-Distrain-Nonce"
SIZE_MARGIN_BYTES = 1 << 20
"""What a peer's serialized state may exceed this rank's own tensors' bytes by (torch.save's
framing of a few thousand entries and the cipher's nonce and tag are well under this)."""
NONCES_KEPT = 1 << 16
"""Request nonces a server remembers, to refuse a captured request sent again (64 hex digits
each: a few MB at most)."""
_AEAD_NONCE_BYTES = 12
TORCHFT_KEYS = frozenset({"step", "batches_committed"})


def _cpu(state: Any) -> Any:
    if isinstance(state, dict):
        return {key: _cpu(value) for key, value in state.items()}
    if isinstance(state, torch.Tensor):
        return state.detach().cpu()
    return state


def _tensor_bytes(state: Any) -> int:
    if isinstance(state, dict):
        return sum(_tensor_bytes(v) for v in state.values())
    return state.numel() * state.element_size() if isinstance(state, torch.Tensor) else 0


def check_schema(template: Any, received: Any, where: str = "state") -> None:
    """`received` has exactly `template`'s nested keys, and each tensor its dtype and shape;
    PeerRefused names the first difference."""
    if isinstance(template, dict):
        if not isinstance(received, dict):
            raise PeerRefused(f"{where}: a {type(received).__name__}, not a dict")
        if set(received) != set(template):
            extra, missing = set(received) - set(template), set(template) - set(received)
            raise PeerRefused(
                f"{where}: keys differ (extra {sorted(map(str, extra))[:3]}, "
                f"missing {sorted(map(str, missing))[:3]})"
            )
        for key, value in template.items():
            check_schema(value, received[key], f"{where}.{key}")
    elif isinstance(template, torch.Tensor):
        if not isinstance(received, torch.Tensor):
            raise PeerRefused(f"{where}: a {type(received).__name__}, not a tensor")
        if received.dtype != template.dtype or received.shape != template.shape:
            raise PeerRefused(
                f"{where}: {received.dtype} {tuple(received.shape)} from the peer, "
                f"{template.dtype} {tuple(template.shape)} here"
            )


class StateTransport(CheckpointTransport[dict[str, Any]]):
    """torchft's checkpoint transport for distrain's live state (see the module docstring).

    `group`, `rank`: this rank's replica group and its rank in it: what it serves as, and whom it
    fetches from (the same rank of another group). `local_state` gives this rank's own live
    state (nested dicts of tensors): the schema a peer's must match. `step_of` reads the
    trainer's step from such a state."""

    def __init__(
        self,
        *,
        bind: str,
        secret: bytes,
        group: int,
        rank: int,
        timeout: timedelta,
        local_state: Callable[[], dict[str, Any]],
        step_of: Callable[[dict[str, Any]], int],
    ) -> None:
        self._secret, self._timeout = secret, timeout
        self._group, self._rank = group, rank
        self._local_state, self._step_of = local_state, step_of
        self._lock = threading.Condition()
        self._staged: tuple[int, bytes] | None = None
        self._used_nonces: OrderedDict[str, None] = OrderedDict()
        self._refused_from: set[str] = set()
        transport = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                transport._serve(self)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                pass

        family = socket.AF_INET6 if ":" in bind else socket.AF_INET
        server_class = type("StateServer", (ThreadingHTTPServer,), {"address_family": family})
        self._server = server_class((bind, 0), Handler)
        self._server.daemon_threads = True
        self._address = f"http://{url_host(bind)}:{self._server.server_address[1]}/"
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="replica-state-server", daemon=True
        )
        self._thread.start()

    # --- serving -------------------------------------------------------------------------------

    def metadata(self) -> str:
        """This rank's signed state address (see the module docstring)."""
        proof = mac(self._secret, "state-address", self._group, self._rank, self._address)
        return f"{self._address}#{self._group}.{self._rank}.{proof.hex()}"

    def send_checkpoint(
        self, dst_ranks: list[int], step: int, state_dict: dict[str, Any], timeout: timedelta
    ) -> None:
        buffer = io.BytesIO()
        torch.save(_cpu(state_dict), buffer)
        with self._lock:
            self._staged = (step, buffer.getvalue())
            self._lock.notify_all()

    def disallow_checkpoint(self) -> None:
        # The peers that needed the state fetched it before this step's exchange, which this
        # rank's vote follows: the bytes are not needed any more.
        with self._lock:
            self._staged = None

    def _serve(self, request: BaseHTTPRequestHandler) -> None:
        parts = request.path.strip("/").split("/")
        nonce = request.headers.get(NONCE_HEADER, "")
        auth = request.headers.get(AUTH_HEADER, "")
        well_formed = (
            len(parts) == 2 and parts[0] == "state" and parts[1].isdigit() and _is_hex(nonce)
        )
        step = int(parts[1]) if well_formed else -1
        own = self._request_mac(self._group, self._rank, step, nonce)
        proven = well_formed and _is_hex(auth) and same_mac(bytes.fromhex(auth), own)
        if not (proven and self._first_use(nonce)):
            peer = request.client_address[0]
            if peer not in self._refused_from:
                self._refused_from.add(peer)
                log.warning(
                    "refused a request for the live state from %s (%s): it did not prove the "
                    "run secret (fault_tolerance.secret_file) for this rank, or was sent before",
                    peer,
                    request.path[:100],
                )
            request.send_error(403, "the request did not prove the run secret")
            return
        with self._lock:
            ready = self._lock.wait_for(
                lambda: self._staged is not None and self._staged[0] == step,
                timeout=self._timeout.total_seconds(),
            )
            body = self._staged[1] if ready and self._staged is not None else None
        if body is None:
            request.send_error(409, f"the live state of step {step} is not served here")
            return
        sealed = seal(self._secret, self._group, self._rank, step, nonce, body)
        request.send_response(200)
        request.send_header("Content-Type", "application/octet-stream")
        request.send_header("Content-Length", str(len(sealed)))
        request.end_headers()
        request.wfile.write(sealed)

    def _first_use(self, nonce: str) -> bool:
        """Whether `nonce` is new here (then it is remembered); a request carrying a nonce seen
        before is a captured one sent again."""
        with self._lock:
            if nonce in self._used_nonces:
                return False
            self._used_nonces[nonce] = None
            if len(self._used_nonces) > NONCES_KEPT:
                self._used_nonces.popitem(last=False)
            return True

    # --- fetching ------------------------------------------------------------------------------

    def recv_checkpoint(
        self, src_rank: int, metadata: str, step: int, timeout: timedelta
    ) -> dict[str, Any]:
        group, rank, address = self._signed_address(metadata)
        template = _cpu(self._local_state())
        limit = _tensor_bytes(template) + SIZE_MARGIN_BYTES
        nonce = secrets.token_hex(32)
        request = urllib.request.Request(
            f"http://{address.netloc}/state/{step}",
            headers={
                NONCE_HEADER: nonce,
                AUTH_HEADER: self._request_mac(group, rank, step, nonce).hex(),
            },
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout.total_seconds()) as response:
                sealed = response.read(limit + 1)
        except urllib.error.HTTPError as error:
            if error.code == 409:  # the peer has not staged this step: a race, not a refusal
                raise
            raise PeerRefused(
                f"{address.netloc} answered the request for the live state with HTTP "
                f"{error.code}: not a distrain group with this run's secret"
            ) from None
        if len(sealed) > limit:
            raise PeerRefused(f"the peer's live state is over {limit} bytes, this rank's size")
        try:
            body = unseal(self._secret, group, rank, step, nonce, sealed)
        except (InvalidTag, ValueError):
            raise PeerRefused(
                f"the live state from {address.netloc} did not prove the run secret "
                "(fault_tolerance.secret_file)"
            ) from None
        try:
            state = torch.load(io.BytesIO(body), weights_only=True, map_location="cpu")
        except Exception as error:  # noqa: BLE001 (any decoding failure is a refusal)
            raise PeerRefused(
                f"the live state from {address.netloc} is not data: {error}"
            ) from None
        if not isinstance(state, dict) or set(state) != {"user", "torchft"}:
            raise PeerRefused("the peer's live state is not {'user', 'torchft'}")
        manager = state["torchft"]
        if (
            not isinstance(manager, dict)
            or set(manager) != TORCHFT_KEYS
            or not all(type(v) is int and v >= 0 for v in manager.values())
        ):
            raise PeerRefused("the peer's torchft state is not {step, batches_committed}")
        check_schema({"distrain": template}, state["user"], "live state")
        steps = {manager["step"], self._step_of(state["user"]["distrain"]), step}
        if len(steps) != 1:
            raise PeerRefused(f"the peer's live state is of steps {sorted(steps)}, not {step}")
        return state

    def _signed_address(self, metadata: str) -> tuple[int, int, Any]:
        """(group, rank, address) of a peer's published state address, believed only when it
        is signed under the run secret for this rank's counterpart: the same rank of another
        group."""
        base, _, signature = metadata.partition("#")
        fields = signature.split(".")
        address = urlsplit(base)
        if address.scheme != "http" or not address.hostname or address.port is None:
            raise PeerRefused(
                f"the peer's state address {metadata[:200]!r} is not http://host:port/"
            )
        signed = (
            len(fields) == 3
            and fields[0].isdigit()
            and fields[1].isdigit()
            and _is_hex(fields[2])
            and same_mac(
                bytes.fromhex(fields[2]),
                mac(self._secret, "state-address", int(fields[0]), int(fields[1]), base),
            )
        )
        if not signed:
            raise PeerRefused(
                f"the peer's state address {base[:200]!r} is not signed with the run secret "
                "(fault_tolerance.secret_file): planted in a manager server by another host?"
            )
        group, rank = int(fields[0]), int(fields[1])
        if rank != self._rank or group == self._group:
            raise PeerRefused(
                f"the state address is group {group} rank {rank}'s, not the counterpart of "
                f"group {self._group} rank {self._rank}"
            )
        return group, rank, address

    def _request_mac(self, group: int, rank: int, step: int, nonce: str) -> bytes:
        return mac(self._secret, "state-request", group, rank, step, nonce)

    def shutdown(self, wait: bool = True) -> None:
        self._server.shutdown()
        self._server.server_close()
        if wait:
            self._thread.join()


def _state_key(secret: bytes, group: int, rank: int, step: int, nonce: str) -> tuple[bytes, bytes]:
    """The cipher key of one request's body and its associated data."""
    key = mac(secret, "state-key", group, rank, step, nonce)
    return key, f"distrain-live-state\0{group}\0{rank}\0{step}\0{nonce}".encode()


def seal(secret: bytes, group: int, rank: int, step: int, nonce: str, body: bytes) -> bytes:
    """`body` encrypted and authenticated for the request (`group`, `rank`, `step`, `nonce`):
    a random cipher nonce, then ChaCha20-Poly1305's ciphertext and tag."""
    key, associated = _state_key(secret, group, rank, step, nonce)
    aead_nonce = secrets.token_bytes(_AEAD_NONCE_BYTES)
    return aead_nonce + ChaCha20Poly1305(key).encrypt(aead_nonce, body, associated)


def unseal(secret: bytes, group: int, rank: int, step: int, nonce: str, sealed: bytes) -> bytes:
    """The body `seal` sealed for this request; InvalidTag if it was sealed for another, under
    another secret, or changed on the way."""
    key, associated = _state_key(secret, group, rank, step, nonce)
    aead_nonce, ciphertext = sealed[:_AEAD_NONCE_BYTES], sealed[_AEAD_NONCE_BYTES:]
    return ChaCha20Poly1305(key).decrypt(aead_nonce, ciphertext, associated)


def _is_hex(text: str) -> bool:
    try:
        bytes.fromhex(text)
    except ValueError:
        return False
    return bool(text)
