"""What a replica group believes of its peers: the run secret, the address it listens on, and the
proof each group gives with every step's exchange.

The lighthouse, torchft's manager servers and its process groups authenticate nobody: any host
that reaches them can join a quorum. distrain therefore checks, itself, everything it takes from
a peer:

- **The live state** a rejoining group fetches travels over `transport.py`, whose every
  request and response carries an HMAC-SHA256 under the run secret (`fault_tolerance.
  secret_file`), and which holds tensors and integers only (`torch.load(weights_only=True)`,
  then an exact key, dtype and shape schema): no pickle of objects.
- **Every step's exchange** carries, beside the gradients, one slot per group of the quorum:
  its group id, its step, the norm of its gradient shard, its loss and a MAC of (quorum, step,
  slot, group, members) under the secret. Adding into an all-reduce cannot forge a slot without
  the secret, so a member that cannot prove the secret, names a group that is not one of
  `fault_tolerance.replica_groups` (or one already present), is at another step, or sends a
  non-finite or far larger gradient than the others (`fault_tolerance.peer_grad_norm_ratio`), is
  named and the step is not committed by any honest group: its gradients are never applied.
- **Binding**: the manager front (manager_front.py: torchft's manager server itself listens on
  loopback only) and the state transport listen on one address, by default the one this host
  uses to reach the lighthouse (`default_bind`), not on every interface.

Without a secret (allowed only with the lighthouse on a loopback address: every group on this
host) the MACs are keyed with the empty string: they prove nothing, the schema and the sanity
rules still hold.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import re
import secrets
import socket
import statistics
from dataclasses import dataclass

import torch

from distrain.ft.network import lighthouse_host

SLOT_MAC_CHUNKS = 8
"""A slot's MAC: 128 bits as eight 16-bit integers, each exact in fp32 through an average."""
SLOT_SIZE = SLOT_MAC_CHUNKS + 5
"""MAC chunks, group, step (two 16-bit halves), gradient norm, loss."""


class PeerRefused(RuntimeError):
    """What a peer sent (its live state, its slot of a step's exchange) is not believed."""


def default_bind(lighthouse: str) -> str:
    """The address of this host's interface toward the lighthouse: the one the other groups,
    who reach the same lighthouse, can reach this group by. No packet is sent (a UDP socket's
    connect only picks the route)."""
    host, port = lighthouse_host(lighthouse)
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(address)
        return probe.getsockname()[0]


def advertised_host(bind: str) -> str:
    """The name peers reach a server bound to `bind` by: this host's name when it resolves to
    `bind` (what torchft advertises by default; advertising the address itself made a group's
    third start fail its vote to commit 27 s in, twice, in tests/test_replica_groups.py, for a
    reason not found in torchft 0.2.0), else the address."""
    try:
        names = {info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None)}
    except OSError:
        names = set()
    return socket.gethostname() if bind in names else url_host(bind)


def url_host(address: str) -> str:
    """`address` as the host part of a URL or a host:port pair (IPv6 in brackets)."""
    return f"[{address}]" if ":" in address else address


def mac(secret: bytes, *parts: object) -> bytes:
    """HMAC-SHA256 under `secret` of `parts`, each written out and separated unambiguously."""
    message = b"\x00".join(str(p).encode() for p in parts)
    return hmac.new(secret, message, hashlib.sha256).digest()


def same_mac(a: bytes, b: bytes) -> bool:
    return hmac.compare_digest(a, b)


# --- the replica id a group announces to the lighthouse ---------------------------------------

_REPLICA_ID = re.compile(r"([0-9a-f]{12})-([0-9a-f]{32})-group([0-9]{1,6})")


def _replica_proof(secret: bytes, group: int, nonce: str) -> str:
    return mac(secret, "replica-id", group, nonce)[:16].hex()


def replica_id(secret: bytes, group: int) -> str:
    """The replica id group `group` gives torchft's manager: with a secret, `NONCE-PROOF-groupN`
    (a random 48-bit nonce, a 128-bit HMAC of (group, nonce) under the secret), which a
    lighthouse started with the same secret checks (`proven_group`); without one, `groupN`.
    torchft appends `:UUID` and reads the group from the id's trailing digits, so the group
    number stays last."""
    if not secret:
        return f"group{group}"
    nonce = secrets.token_hex(6)
    return f"{nonce}-{_replica_proof(secret, group, nonce)}-group{group}"


def proven_group(secret: bytes, replica_id: str) -> int | None:
    """The group whose proof of `secret` the lighthouse-facing `replica_id` (`replica_id(...)`,
    then torchft's `:UUID`) carries; None when it carries none or a wrong one."""
    head, _, tail = replica_id.partition(":")
    match = _REPLICA_ID.fullmatch(head)
    if match is None or len(tail) > 64:
        return None
    nonce, proof, group = match.groups()
    expected = _replica_proof(secret, int(group), nonce)
    return int(group) if same_mac(proof.encode(), expected.encode()) else None


# --- the slots of a step's exchange ------------------------------------------------------------


@dataclass(frozen=True)
class Round:
    """What every honest member of a step's exchange agrees on before it starts."""

    secret: bytes
    quorum_id: int
    step: int
    groups: tuple[int, ...]
    """The replica groups of the quorum, as torchft's process group ranks name them."""
    members: int
    """The quorum's members (torchft's participants): one slot each."""
    num_groups: int
    """fault_tolerance.replica_groups."""

    def slot_mac(self, slot: int, group: int, step: int) -> list[int]:
        members = ",".join(map(str, self.groups))
        digest = mac(self.secret, "slot", self.quorum_id, step, slot, group, members)
        return [int.from_bytes(digest[2 * i : 2 * i + 2], "big") for i in range(SLOT_MAC_CHUNKS)]


def slots(
    round_: Round, *, slot: int, group: int, grad_norm: torch.Tensor, loss: torch.Tensor
) -> torch.Tensor:
    """This group's slots block (zeros but at `slot`), on the device of `grad_norm`: added
    to the exchange, whose average then holds every member's slot divided by their number."""
    block = torch.zeros(round_.members * SLOT_SIZE, device=grad_norm.device, dtype=torch.float32)
    fixed = [*round_.slot_mac(slot, group, round_.step), group]
    fixed += [round_.step & 0xFFFF, round_.step >> 16]
    start = slot * SLOT_SIZE
    block[start : start + len(fixed)] = torch.tensor(fixed, dtype=torch.float32)
    block[start + len(fixed)] = grad_norm.float()
    block[start + len(fixed) + 1] = loss.detach().float()
    return block


def check_slots(round_: Round, averaged: list[float], *, ratio: float) -> str:
    """Why the exchange's averaged slots (host floats, one block per member) are not believed,
    or "" when every member proved the secret at the quorum's step and no gradient is an
    outlier. `ratio`: a gradient norm above `ratio` x the median of the others' is refused
    (0 = no such check)."""
    members = round_.members
    if len(averaged) != members * SLOT_SIZE:
        return f"the exchange holds {len(averaged) // SLOT_SIZE} slots for {members} members"
    seen: dict[int, int] = {}
    norms: dict[int, float] = {}
    for slot in range(members):
        values = [v * members for v in averaged[slot * SLOT_SIZE : (slot + 1) * SLOT_SIZE]]
        if not all(math.isfinite(v) for v in values[: SLOT_MAC_CHUNKS + 3]):
            return f"slot {slot} of the exchange is not a number: a member without the run secret"
        ints = [round(v) for v in values[: SLOT_MAC_CHUNKS + 3]]
        claimed, group = ints[:SLOT_MAC_CHUNKS], ints[SLOT_MAC_CHUNKS]
        step = ints[SLOT_MAC_CHUNKS + 1] + (ints[SLOT_MAC_CHUNKS + 2] << 16)
        if claimed != round_.slot_mac(slot, group, step):
            return (
                f"the member in slot {slot} (calling itself group {group}) did not prove the "
                "run secret (fault_tolerance.secret_file)"
            )
        if not 0 <= group < round_.num_groups:
            return (
                f"group {group} is not one of the fault_tolerance.replica_groups = "
                f"{round_.num_groups} groups"
            )
        if group in seen:
            return f"two members of the quorum call themselves group {group}"
        if step != round_.step:
            return f"group {group} is at step {step}, the quorum at step {round_.step}"
        seen[group] = slot
        norms[group] = values[SLOT_MAC_CHUNKS + 3]
    if sorted(seen) != sorted(round_.groups):
        return f"the exchange's groups {sorted(seen)} are not the quorum's {list(round_.groups)}"
    for group, norm in norms.items():
        if not math.isfinite(norm):
            return f"group {group}'s gradient is not finite (norm {norm})"
        others = [n for g, n in norms.items() if g != group]
        if ratio and others and norm > ratio * max(statistics.median(others), 1e-12):
            return (
                f"group {group}'s gradient norm {norm:.4g} is over {ratio:g} x the others' "
                f"median {statistics.median(others):.4g} (fault_tolerance.peer_grad_norm_ratio)"
            )
    return ""
