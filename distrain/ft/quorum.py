"""When the lighthouse issues a quorum of replica groups, and without whom: torchft's rules
(its lighthouse's `quorum_compute`, which torchft's managers expect) with one addition, groups
known to be gone.

torchft decides that a group is gone only when its heartbeats stop for the heartbeat timeout.
That one number must then be short (the survivors wait that long after a kill) and long (a
group starved of CPU for that long is evicted, and comes back with a transfer of the live state).
Here a group is also gone once its manager server refuses a connection (`gone`): a process that
died leaves its port closed and its host answers at once, so the lighthouse checks the groups
of every pending quorum (`to_probe`) and the heartbeat timeout can stay long, for hosts that
vanish without an answer.

The rules, in torchft's order, over the healthy groups (a heartbeat within the timeout, not
gone) and the healthy participants (healthy groups that asked for the next quorum):
1. a quorum whose every member is a healthy participant again is issued at once (fast quorum);
   if any participant asks for shrink_only, only the previous members are candidates;
2. fewer than `min_replicas` participants, or no more than half of the healthy groups: wait;
3. every healthy group a participant: issue; else wait for the stragglers up to the join
   timeout from the first participant's request, then issue without them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Participant:
    member: Any  # lighthouse_wire.QuorumMember
    joined: float


@dataclass
class QuorumState:
    """The lighthouse's state; every method is called under its lock, with `now` in seconds of
    a monotonic clock."""

    heartbeat_timeout_s: float
    join_timeout_s: float
    min_replicas: int
    heartbeats: dict[str, float] = field(default_factory=dict)
    participants: dict[str, Participant] = field(default_factory=dict)
    addresses: dict[str, str] = field(default_factory=dict)
    """Every group's manager server address, from its quorum requests."""
    gone: dict[str, float] = field(default_factory=dict)
    """The groups found gone, by when (forgotten a heartbeat timeout later: `forget`)."""
    previous: list[Any] | None = None
    quorum_id: int = 0

    def heartbeat(self, replica_id: str, now: float) -> None:
        self.heartbeats[replica_id] = now

    def request(self, member: Any, now: float) -> None:
        """`member` asks to join the next quorum (a request is a heartbeat too)."""
        self.heartbeat(member.replica_id, now)
        if member.address:
            self.addresses[member.replica_id] = member.address
        self.participants[member.replica_id] = Participant(member, now)

    def mark_gone(self, replica_id: str, now: float = 0.0) -> None:
        """`replica_id`'s process is gone: left out from now on (a restarted group's manager
        has a replica id of its own)."""
        self.gone[replica_id] = now
        self.participants.pop(replica_id, None)
        self.heartbeats.pop(replica_id, None)

    def tracked(self) -> int:
        """The replica ids held in memory."""
        return len(self.heartbeats.keys() | self.participants.keys() | self.gone.keys())

    def knows(self, replica_id: str) -> bool:
        return replica_id in self.heartbeats or replica_id in self.participants

    def forget(self, now: float) -> set[str]:
        """Drop every id that can no longer count (no heartbeat for the heartbeat timeout, not
        waiting for a quorum; gone for a heartbeat timeout): their memory is freed. Returns
        them."""
        stale = {
            rid
            for rid, last in self.heartbeats.items()
            if now - last >= self.heartbeat_timeout_s and rid not in self.participants
        }
        stale |= {rid for rid, when in self.gone.items() if now - when >= self.heartbeat_timeout_s}
        for rid in stale:
            self.heartbeats.pop(rid, None)
            self.gone.pop(rid, None)
        for rid in [r for r in self.addresses if not self.knows(r)]:
            del self.addresses[rid]
        return stale

    def healthy(self, now: float) -> set[str]:
        return {
            rid
            for rid, last in self.heartbeats.items()
            if now - last < self.heartbeat_timeout_s and rid not in self.gone
        }

    def to_probe(self, now: float) -> dict[str, str]:
        """While a quorum is pending (someone asked for it), every healthy group by address:
        the stragglers it would wait for, and the participants it would take in (a group that
        asked and then died before the quorum was issued)."""
        if not self.participants:
            return {}
        return {rid: self.addresses[rid] for rid in self.healthy(now) if rid in self.addresses}

    def compute(self, now: float) -> tuple[list[Any] | None, str]:
        """The members of the quorum to issue now (None: wait), and why."""
        healthy = self.healthy(now)
        ready = {rid: p for rid, p in self.participants.items() if rid in healthy}
        candidates = [ready[rid].member for rid in sorted(ready)]
        shrink_only = any(p.member.shrink_only for p in ready.values())
        status = f"{len(ready)}/{len(self.participants)} participants healthy, {len(healthy)} "
        status += f"heartbeating, {len(self.gone)} gone"
        if self.previous is not None:
            before = {m.replica_id for m in self.previous}
            if shrink_only:
                candidates = [m for m in candidates if m.replica_id in before]
            if before <= set(ready):
                return candidates, f"fast quorum ({status})"
        if len(ready) < self.min_replicas:
            return None, f"fewer than {self.min_replicas} participants ({status})"
        if len(ready) <= len(healthy) // 2:
            return None, f"no majority of the heartbeating groups ({status})"
        first = min((p.joined for p in ready.values()), default=now)
        if len(ready) < len(healthy) and now - first < self.join_timeout_s:
            return None, f"waiting for stragglers ({status})"
        return candidates, f"quorum ({status})"

    def issue(self, members: list[Any]) -> bool:
        """Record `members` as the new quorum (its id moves on when the membership changed or
        a member reports failed commits); True when the membership changed."""
        ids = [m.replica_id for m in members]
        changed = self.previous is None or ids != [m.replica_id for m in self.previous]
        if changed or any(m.commit_failures > 0 for m in members):
            self.quorum_id += 1
        self.previous = members
        self.participants.clear()
        return changed
