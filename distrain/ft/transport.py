"""The live state a rejoining replica group fetches from a peer, as data only and authenticated.

torchft's default transport (HTTPTransport) serves a pickle of the state and loads the peer's
with `weights_only=False`: any host that joins the quorum at a higher step makes the others run
its code. This transport replaces it (torchft's `CheckpointTransport` interface):

- **Served**: the state is staged once per `send_checkpoint` as `torch.save` bytes of nested
  dicts of CPU tensors and integers, on an HTTP server bound to one address
  (`fault_tolerance.bind`), at `/state/<step>`. A request must carry a fresh nonce and
  HMAC(secret, step, nonce); one without is refused (403) and logged once per address.
- **Fetched**: the response must carry HMAC(secret, step, nonce, SHA-256 of the body) and be no
  larger than the local state plus a margin; only then is it read, with
  `torch.load(weights_only=True)`, and believed only if its keys, dtypes and shapes are exactly
  this rank's own state's and its steps are the quorum's.

A refusal raises `PeerRefused`: torchft records the error, no group commits the step, and
`ReplicaGroups` stops the run after a few refusals in a row (replica_groups.py).
"""

from __future__ import annotations

import hashlib
import io
import logging
import secrets
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

import torch
from torchft.checkpointing.transport import CheckpointTransport

from distrain.ft.trust import PeerRefused, mac, same_mac, url_host

log = logging.getLogger(__name__)

AUTH_HEADER = "X-Distrain-Auth"
NONCE_HEADER = "X-Distrain-Nonce"
SIZE_MARGIN_BYTES = 1 << 20
"""What a peer's serialized state may exceed this rank's own tensors' bytes by (torch.save's
framing of a few thousand entries is well under this)."""
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

    `local_state` gives this rank's own live state (nested dicts of tensors): the schema a
    peer's must match. `step_of` reads the trainer's step from such a state."""

    def __init__(
        self,
        *,
        bind: str,
        secret: bytes,
        timeout: timedelta,
        local_state: Callable[[], dict[str, Any]],
        step_of: Callable[[dict[str, Any]], int],
    ) -> None:
        self._secret, self._timeout = secret, timeout
        self._local_state, self._step_of = local_state, step_of
        self._lock = threading.Condition()
        self._staged: tuple[int, bytes] | None = None
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
        return self._address

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
        if not (
            well_formed
            and _is_hex(auth)
            and same_mac(bytes.fromhex(auth), self._request_mac(step, nonce))
        ):
            peer = request.client_address[0]
            if peer not in self._refused_from:
                self._refused_from.add(peer)
                log.warning(
                    "refused a request for the live state from %s (%s): it did not prove the "
                    "run secret (fault_tolerance.secret_file)",
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
        request.send_response(200)
        request.send_header("Content-Type", "application/octet-stream")
        request.send_header("Content-Length", str(len(body)))
        request.send_header(AUTH_HEADER, self._response_mac(step, nonce, body).hex())
        request.end_headers()
        request.wfile.write(body)

    # --- fetching ------------------------------------------------------------------------------

    def recv_checkpoint(
        self, src_rank: int, metadata: str, step: int, timeout: timedelta
    ) -> dict[str, Any]:
        address = urlsplit(metadata)
        if address.scheme != "http" or not address.hostname or address.port is None:
            raise PeerRefused(
                f"the peer's state address {metadata[:200]!r} is not http://host:port/"
            )
        template = _cpu(self._local_state())
        limit = _tensor_bytes(template) + SIZE_MARGIN_BYTES
        nonce = secrets.token_hex(32)
        request = urllib.request.Request(
            f"http://{address.netloc}/state/{step}",
            headers={NONCE_HEADER: nonce, AUTH_HEADER: self._request_mac(step, nonce).hex()},
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout.total_seconds()) as response:
                auth = response.headers.get(AUTH_HEADER, "")
                body = response.read(limit + 1)
        except urllib.error.HTTPError as error:
            if error.code == 409:  # the peer has not staged this step: a race, not a refusal
                raise
            raise PeerRefused(
                f"{address.netloc} answered the request for the live state with HTTP "
                f"{error.code}: not a distrain group with this run's secret"
            ) from None
        if len(body) > limit:
            raise PeerRefused(f"the peer's live state is over {limit} bytes, this rank's size")
        if not _is_hex(auth) or not same_mac(
            bytes.fromhex(auth), self._response_mac(step, nonce, body)
        ):
            raise PeerRefused(
                f"the live state from {address.netloc} did not prove the run secret "
                "(fault_tolerance.secret_file)"
            )
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

    def _request_mac(self, step: int, nonce: str) -> bytes:
        return mac(self._secret, "state-request", step, nonce)

    def _response_mac(self, step: int, nonce: str, body: bytes) -> bytes:
        return mac(self._secret, "state", step, nonce, hashlib.sha256(body).hexdigest())

    def shutdown(self, wait: bool = True) -> None:
        self._server.shutdown()
        self._server.server_close()
        if wait:
            self._thread.join()


def _is_hex(text: str) -> bool:
    try:
        bytes.fromhex(text)
    except ValueError:
        return False
    return bool(text)
