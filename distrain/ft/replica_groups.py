"""Replica groups that survive each other (fault_tolerance.replica_groups = R >= 2), on torchft.

Each group is its own torchrun: its ranks shard the model with FSDP2 (ZeRO-2/3), tp and pp
(every group the same layout) and reduce the gradients among themselves; the groups then
average the gradient shards over torchft's reconfigurable process group (rank s of every group
holds the same shard: the same FSDP2 shard of the same tp shard of the same pipeline stage).
Before each step the groups form a quorum through the lighthouse (`distrain lighthouse`, on
torchft's protocol); after backward each group votes to commit.

- **A group fails** (a rank dies: the collective between groups errs; a rank hangs: it outlasts
  fault_tolerance.timeout_s): no group commits the step. The survivors form a new quorum without
  the failed group and redo the same step: the data loader is rewound and re-planned so that
  the live groups' ranks split the *same* global batch (each now takes more micro-batches), so
  the step's loss and update are the uninterrupted run's, up to the order of the fp32 sums. No
  process restarts and nothing is read from storage.
- **A group comes back** (its torchrun restarted its workers): it joins a quorum at a step
  boundary and fetches the live state from a healthy group: each rank's model and optimizer
  shards (its counterpart holds the same ones), the loader position, the RNG states and the
  step, over distrain's own transport (transport.py: tensors and integers only,
  authenticated and encrypted under the run secret, checked against this rank's own schema;
  never a pickle).
- **Manager servers**: torchft's, in each group's rank 0, listens on loopback behind a front
  that lets through only connections proving the run secret, and every client torchft makes
  goes through a tunnel that proves it (manager_front.py).
- **Trust**: each quorum's replica ids must carry a proof of the run secret (trust.replica_id;
  a lighthouse started without the secret lets anyone into a quorum), and every step's
  exchange carries each group's proof of the secret and its gradient norm (trust.py): a
  member that fails either is named and the step is committed by no honest group. After
  `REFUSALS_BEFORE_STOP` refused attempts in a row the group stops with one line
  (`ReplicaPeerRefused`) rather than train with a peer it cannot believe: an intruder can
  stop the run that way, never steer it.

Every membership change is a metrics row (see `ReplicaGroups`). The trainer (train/loop.py)
calls `begin` once, runs each step inside `until_committed` (which redoes it until every group
of the quorum commits it), calls `average` between backward and the update, and `next_quorum`
after each step but the last.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from distrain.config.schema import FaultToleranceConfig
from distrain.data.loader import DistributedBatchLoader
from distrain.errors import DistrainError
from distrain.ft.lighthouse import HEARTBEAT_INTERVAL_MS
from distrain.ft.manager_front import ManagerTunnels, fronted_manager_servers
from distrain.ft.network import read_secret
from distrain.ft.trust import (
    PeerRefused,
    Round,
    advertised_host,
    check_slots,
    default_bind,
    proven_group,
    replica_id,
    slots,
)
from distrain.observe.logs import FILE_ONLY
from distrain.observe.metrics import MetricsWriter
from distrain.parallel.device import DistContext, replica_process_group

T = TypeVar("T")

_STORE_ADDRESS_BYTES = 256
_GATHER_POLL_S = 0.05
QUORUM_ATTEMPTS = 4
"""A quorum request is sent again after fault_tolerance.quorum_timeout_s / QUORUM_ATTEMPTS: a
lighthouse that died (SIGKILL, a host reboot) takes the requests it held with it, and torchft
0.2.0's manager server does not send them to the lighthouse restarted (or replaced) on its
address, but answers a new one through it."""
REFUSALS_BEFORE_STOP = 3
"""Refused attempts in a row (a peer's state or slot not believed) after which a group stops."""


class ReplicaGroupAlone(DistrainError):
    """A restarted replica group found no peer to take the live state from."""


class ReplicaPeerRefused(DistrainError):
    """A peer of the quorum was refused REFUSALS_BEFORE_STOP times in a row: the group stops."""


class StepNotCommitted(RuntimeError):
    """Some group failed during this step: no group applies it; the survivors redo it."""


class _NotFlightRecorder(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "flight recorder" not in record.getMessage()


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The part of `tensor` this rank holds (a DTensor's local shard)."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def transferable(state: dict[str, Any]) -> dict[str, Any]:
    """`state` (nested dicts) with each DTensor replaced by its local shard and everything that
    is not a tensor dropped: what a rank sends to its counterpart in a rejoining group, which
    holds the same shards."""
    out: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, dict):
            out[key] = transferable(value)
        elif isinstance(value, torch.Tensor):
            out[key] = _local(value)
    return out


def copy_into(template: dict[str, Any], received: dict[str, Any], *, where: str = "") -> None:
    """Copy `received`'s tensors into `template`'s (local shards, in place); a key or shape
    that does not match is an error naming it."""
    for key, value in template.items():
        name = f"{where}{key}"
        if isinstance(value, dict):
            copy_into(value, received[key], where=f"{name}.")
        elif isinstance(value, torch.Tensor):
            if key not in received:
                raise KeyError(f"live state from the peer group lacks {name}")
            local, theirs = _local(value), received[key]
            if local.shape != theirs.shape:
                raise ValueError(
                    f"live state {name}: shape {tuple(theirs.shape)} from the peer group, "
                    f"{tuple(local.shape)} here"
                )
            local.copy_(theirs)


def _cause(error: object) -> str:
    """What the failed step's error says, in one word: a hang (timeout) or a collective error."""
    text = str(error).lower()
    return "timeout" if "timeout" in text or "timed out" in text else "collective error"


def _group_store(ctx: DistContext) -> tuple[str, int, dist.TCPStore | None]:
    """A TCP store of this group's own, hosted by its rank 0 (torchft's manager keeps its
    address there; torchrun's store outlives a restart and would hand a new worker the old
    manager's address): rank 0 opens it and tells the other ranks where it is."""
    buffer = torch.zeros(_STORE_ADDRESS_BYTES, dtype=torch.uint8)
    store = None
    if ctx.rank == 0:
        store = dist.TCPStore(socket.gethostname(), 0, is_master=True, wait_for_workers=False)
        address = f"{socket.gethostname()}:{store.port}".encode()
        buffer[: len(address)] = torch.tensor(list(address), dtype=torch.uint8)
    if ctx.world_size > 1:
        # On the default group's device (NCCL broadcasts CUDA tensors only).
        on_device = buffer.to(ctx.device)
        dist.broadcast(on_device, src=0)
        buffer = on_device.cpu()
    host, port = bytes(buffer[buffer != 0].tolist()).decode().rsplit(":", 1)
    return host, int(port), store


class ReplicaGroups:
    """This group's seat among the replica groups: the quorum before each step, the average of
    the gradients between groups after backward, and the live state a rejoining group gets.

    Metrics rows (rank 0 of each group writes its own run dir's metrics.jsonl):
    - `{"step", "replica_change": "lost", "replica_groups_lost", "ranks_lost", "cause",
      "recovery_s", "steps_lost": 0, "attempts", "replica_groups"}` when a step was redone
      without a failed group: recovery_s runs from the start of the failed attempt to the redone
      step's commit;
    - `{"step", "replica_change": "retried", "cause", "recovery_s", "steps_lost": 0, ...}` when a
      step failed but no group was lost (a slow group), and every group redid it;
    - `{"step", "replica_change": "joined", "replica_groups_joined", "replica_groups"}` when a
      group came (back);
    - `{"step", "replica_change": "rejoined", "transfer_s", "state_mb", "replica_groups"}` in the
      rejoining group's own run dir: the live state it fetched.
    - `{"step", "replica_change": "refused", "reason", "refusals"}` for an attempt no honest
      group committed because a peer's state or slot was not believed (trust.py).
    """

    def __init__(
        self,
        cfg: FaultToleranceConfig,
        *,
        ctx: DistContext,
        dp_rank: int,
        dp_size: int,
        metrics: MetricsWriter,
        logger: logging.Logger,
    ):
        """`dp_rank`, `dp_size`: this rank's data-parallel rank and the data-parallel size
        inside its group (the mesh's: ctx.rank and world size only without tp or pp, whose
        ranks of one data-parallel rank read the same batch)."""
        from torchft.manager import Manager

        from distrain.ft.transport import StateTransport

        # torchft warns at every reconfiguration that it cannot reset NCCL's flight recorder
        # (absent on gloo; distrain's flight records are its own, observe/flight.py).
        logging.getLogger("torchft.manager").addFilter(_NotFlightRecorder())

        self.cfg, self.ctx, self.metrics, self.log = cfg, ctx, metrics, logger
        self.group = cfg.group
        self.group_size = ctx.world_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        lighthouse = cfg.lighthouse or os.environ["TORCHFT_LIGHTHOUSE"]
        # Without a secret (the rule table allows it with a loopback lighthouse only) the MACs
        # are keyed with b"": they prove nothing, the schema and the sanity rules still hold.
        self.secret = read_secret(cfg.secret_file) if cfg.secret_file else b""
        bind = cfg.bind or default_bind(lighthouse)
        host, port, self._store = _group_store(ctx)
        self._pg = replica_process_group(ctx.backend, cfg.timeout_s)
        self._state: Callable[[], dict[str, Any]] | None = None
        self.transport = StateTransport(
            bind=bind,
            secret=self.secret,
            group=cfg.group,
            rank=ctx.rank,
            timeout=timedelta(seconds=cfg.timeout_s),
            local_state=lambda: self._state(),  # type: ignore[misc] (set by serve)
            step_of=lambda state: int(state["trainer"]["step"]),
        )
        # Every manager server is reached through a front that checks the run secret
        # (manager_front.py): this process's clients through tunnels, its own server (rank 0)
        # behind a front on `bind`.
        self._tunnels = ManagerTunnels(self.secret)
        self._tunnels.install()
        with fronted_manager_servers(bind, secret=self.secret, group=cfg.group):
            self.manager = Manager(
                pg=self._pg,
                load_state_dict=None,
                state_dict=None,
                min_replica_size=1,
                use_async_quorum=False,
                timeout=timedelta(seconds=cfg.timeout_s),
                quorum_timeout=timedelta(seconds=cfg.quorum_timeout_s),
                connect_timeout=timedelta(seconds=cfg.quorum_timeout_s),
                rank=ctx.rank,
                world_size=ctx.world_size,
                store_addr=host,
                store_port=port,
                lighthouse_addr=lighthouse,
                hostname=advertised_host(bind),
                checkpoint_transport=self.transport,
                # With a secret it carries a proof of it, checked by `distrain lighthouse
                # --secret-file` (trust.replica_id).
                replica_id=replica_id(self.secret, cfg.group),
                # Every group seeds its model alike: nothing to copy before the first step.
                init_sync=False,
                heartbeat_interval=timedelta(milliseconds=HEARTBEAT_INTERVAL_MS),
            )
        self._quorums = _QuorumIds(self.manager._client)
        self.manager._client = self._quorums
        self.members: tuple[int, ...] = ()
        """The replica groups of the current quorum."""
        self.participants = 0
        self._failed: list[tuple[float, str]] = []
        """(start time, error) of this step's failed attempts."""
        self._lost: set[int] = set()
        """The groups this step's failed attempts lost."""
        self._healed: tuple[float, int] | None = None
        self._refusals = 0
        """Attempts refused in a row (see REFUSALS_BEFORE_STOP)."""
        self._unproven: list[str] = []
        """The replica ids of the current quorum that carry no proof of the run secret."""
        self._step: Callable[[], int] = lambda: 0
        self._loader: DistributedBatchLoader | None = None

    # --- how the trainer runs its steps ------------------------------------------------------

    def begin(
        self,
        *,
        state: Callable[[], dict[str, Any]],
        load: Callable[[dict[str, Any]], None],
        step: Callable[[], int],
        loader: DistributedBatchLoader,
    ) -> None:
        """Before the first step: serve this rank's live state (`state`; `load` takes a
        peer's, see `_serve`), gather the first quorum (which may load a peer's state, and so
        move `step()`, the trainer's step) and refuse a restart that has nothing to resume
        from. `loader` is re-planned at every quorum over the groups in it."""
        self._step, self._loader = step, loader
        self._serve(state, load, step=step())
        self._first_quorum(step=step(), loader=loader)
        self._check_restart_has_a_source(step=step())

    def until_committed(self, attempt: Callable[[], T]) -> T:
        """`attempt()`, one step on this group's share of the global batch, redone until every
        group of the quorum commits it (`average` raises StepNotCommitted when one does not).
        After a failed attempt the loader and the RNG are put back where the step began and
        the survivors' new quorum re-plans the same global batch over the groups left. That
        quorum may also load a peer's live state (this group was cut off while the others went
        on), which moves the trainer's step to the peer's: each attempt takes its step from
        it."""
        assert self._loader is not None, "begin() first"
        while True:
            started = time.perf_counter()
            position, rng = self._loader.state_dict(), torch.get_rng_state()
            try:
                result = attempt()
            except StepNotCommitted as error:
                self._loader.load_state_dict(position)
                torch.set_rng_state(rng)
                self._step_failed(started, error)
                self.quorum(step=self._step(), loader=self._loader)
                continue
            self._step_committed(self._step() + 1)
            return result

    def next_quorum(self) -> None:
        """After a step that is not the last: the quorum of the next one."""
        assert self._loader is not None, "begin() first"
        self.quorum(step=self._step(), loader=self._loader)

    # --- the live state, the quorum ------------------------------------------------------------

    def _serve(
        self,
        state: Callable[[], dict[str, Any]],
        load: Callable[[dict[str, Any]], None],
        *,
        step: int,
    ) -> None:
        """Register how to read this rank's live state and load a peer's (both nested dicts of
        tensors, from `transferable`), this group being at `step` (0, or the checkpoint it
        resumed from): a group behind the others' step loads theirs at its first quorum."""
        self.manager.load_state_dict({"step": step, "batches_committed": 0})
        self._state = state

        def timed_load(received: dict[str, Any]) -> None:
            start = time.perf_counter()
            load(received)
            size = sum(t.numel() * t.element_size() for t in _tensors(received))
            self._healed = (time.perf_counter() - start, size)

        self.manager.register_state_dict_fn("distrain", timed_load, state)

    def _first_quorum(self, *, step: int, loader: DistributedBatchLoader) -> None:
        """The quorum before this group's first step. Groups that start together (none ahead
        of this one's `step`, no restart) gather first: until every one of the
        fault_tolerance.replica_groups groups is in the quorum, or for
        fault_tolerance.quorum_timeout_s, this group joins one quorum after another without
        training. Without it the first group up trains alone and every later one joins with
        a transfer of the live state: a membership change per group at each start. A group
        behind the others (restarted, or started late) takes their live state at once."""
        restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
        # Counted in quorums, not read from a clock: every rank of the group decides alike.
        tries = max(1, round(self.cfg.quorum_timeout_s / _GATHER_POLL_S))
        for _ in range(tries):
            self.members = ()
            self.quorum(step=step, loader=loader)
            gathering = not restarted and self.manager.current_step() == step
            if not gathering or self.participants >= self.cfg.replica_groups:
                return
            time.sleep(_GATHER_POLL_S)
        missing = sorted(set(range(self.cfg.replica_groups)) - set(self.members))
        self.log.warning(
            "replica groups %s did not reach the lighthouse in fault_tolerance.quorum_timeout_s "
            "= %gs: starting with groups %s (they join when they come)",
            missing,
            self.cfg.quorum_timeout_s,
            list(self.members),
        )

    def quorum(self, *, step: int, loader: DistributedBatchLoader) -> None:
        """Join the quorum for the step after `step` (which loads a peer's live state when this
        group is behind) and re-plan `loader` over the groups in it."""
        start = time.perf_counter()
        self._start_quorum()
        self._unproven = _unproven(self.secret, self._quorums.replica_ids)
        participants = self.manager.num_participants()
        replica_rank = self.manager.participating_rank()
        if replica_rank is None:
            raise StepNotCommitted("this replica group is not in the quorum")
        members = self._quorum_groups()
        lost, joined = set(self.members) - set(members), set(members) - set(self.members)
        first = not self.members
        self._lost |= lost if self._failed else set()
        self.members, self.participants = members, participants
        if self._healed is not None:
            load_s, size = self._healed
            # This group took a peer's state at the peer's step: its own failed attempts
            # (cut off from the others) were not a step the quorum redid.
            self._healed, self._failed, self._lost = None, [], set()
            self.metrics.log(
                {
                    "step": self.manager.current_step(),
                    "replica_change": "rejoined",
                    "transfer_s": time.perf_counter() - start,
                    "load_s": load_s,
                    "state_mb": size / 2**20,
                    "replica_groups": participants,
                }
            )
            self.log.info(
                "replica group %d rejoined at step %d with the live state of a peer group",
                self.group,
                self.manager.current_step(),
            )
        elif lost and not self._failed:
            # A group left between steps: nothing to redo.
            self._log_lost(step + 1, lost, cause="left the quorum", error="", started=start)
        elif joined and not first:
            self.metrics.log(
                {
                    "step": step,
                    "replica_change": "joined",
                    "replica_groups_joined": ",".join(map(str, sorted(joined))),
                    "replica_groups": participants,
                }
            )
            self.log.info("replica group(s) %s joined before step %d", sorted(joined), step + 1)
        # The groups' data-parallel ranks, group by group: rank s of every group holds the
        # same shards (tp, pp and FSDP2 coordinates alike), and the tp and pp ranks of one
        # data-parallel rank read the same slice.
        loader.replan(
            dp_rank=replica_rank * self.dp_size + self.dp_rank,
            dp_size=participants * self.dp_size,
        )

    def _start_quorum(self) -> None:
        """torchft's quorum, asked again every quorum_timeout_s / QUORUM_ATTEMPTS until
        fault_tolerance.quorum_timeout_s has passed: a lighthouse down for less than that, or
        restarted, costs a wait and no step."""
        total = self.cfg.quorum_timeout_s
        deadline = time.monotonic() + total
        while True:
            left = deadline - time.monotonic()
            attempt = timedelta(seconds=max(0.1, min(total / QUORUM_ATTEMPTS, left)))
            try:
                self.manager.start_quorum(timeout=attempt)
                return
            except TimeoutError as error:
                # torchft 0.2.0 keeps the failed quorum's future and raises it again at the
                # next start_quorum: this attempt is over, drop it.
                self.manager._quorum_future = None
                if time.monotonic() >= deadline:
                    raise
                self.log.warning(
                    "replica groups: no quorum from the lighthouse in %.1fs (%s): asking again "
                    "(fault_tolerance.quorum_timeout_s = %gs in all)",
                    attempt.total_seconds(),
                    str(error)[:100],
                    total,
                )

    def _check_restart_has_a_source(self, *, step: int) -> None:
        """A restarted group (torchrun's restart count > 0) at step 0, alone in its first quorum,
        has neither a peer's live state nor a checkpoint: training from scratch would only make
        a second run under this group's run dir, so it stops with a one-line error instead."""
        restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        if restarts and step == 0 and self.manager.current_step() == 0 and self.participants == 1:
            raise ReplicaGroupAlone(
                f"replica group {self.group} restarted (restart {restarts}) but no other group is "
                "in the quorum to fetch the live state from, and it has no checkpoint; start it "
                "again while the other groups train, or resume the run from a checkpoint"
            )

    def _quorum_groups(self) -> tuple[int, ...]:
        """The replica groups of the current quorum. torchft hands the quorum's members to its
        process group as global ranks (replica number x group size + group rank) and keeps them
        there (torchft 0.2.0's `_global_ranks`); the replica number is our group's."""
        ranks = getattr(self._pg, "_global_ranks", None) or []
        return tuple(sorted({r // self.group_size for r in ranks}))

    # --- after backward ----------------------------------------------------------------------

    def average(
        self, loss: torch.Tensor, parameters: Callable[[], Iterable[nn.Parameter]]
    ) -> torch.Tensor:
        """Average this rank's gradient shards and `loss` over the groups in the quorum and
        vote to commit the step; returns the groups' mean loss. The exchange carries every
        member's slot (trust.py): a member that is not believed makes this group vote
        against the step. Raises StepNotCommitted, with the gradients cleared, when some group
        failed or was not believed: the caller redoes the step."""
        grads = [_local(p.grad) for p in parameters() if p.grad is not None]
        flat_grads = torch.cat([g.reshape(-1) for g in grads])
        round_ = Round(
            secret=self.secret,
            # torchft 0.2.0 keeps the quorum's id in this private attribute.
            quorum_id=self.manager._quorum_id,
            step=self.manager.current_step(),
            groups=self.members,
            members=self.participants,
            num_groups=self.cfg.replica_groups,
        )
        proof = slots(
            round_,
            slot=self.manager.participating_rank() or 0,
            group=self.group,
            grad_norm=torch.linalg.vector_norm(flat_grads),
            loss=loss,
        )
        flat = torch.cat([flat_grads, loss.detach().reshape(1).float(), proof])
        if self._unproven and self.manager.errored() is None:
            # Refused before the exchange (torchft's allreduce is then a no-op): such a member
            # may never send its part, and the step would wait out fault_tolerance.timeout_s.
            refusal = (
                f"a member of the quorum (replica id {self._unproven[0][:80]!r}) did not prove "
                "the run secret"
            )
            self.log.error("replica groups: %s; the step is not committed", refusal)
            self.manager.report_error(PeerRefused(refusal))
        self.manager.allreduce(flat).wait()
        if self.manager.errored() is None:
            # One small read to the host: should_commit below waits for the device anyway.
            refusal = check_slots(
                round_, flat[-proof.numel() :].tolist(), ratio=self.cfg.peer_grad_norm_ratio
            )
            if refusal:
                self.log.error("replica groups: %s; the step is not committed", refusal)
                self.manager.report_error(PeerRefused(refusal))
        if not self.manager.should_commit():
            error = self.manager.errored()
            for p in parameters():
                p.grad = None
            cause = error.original_exception if error else None
            self._note_refusal(cause)
            raise StepNotCommitted(str(cause or "a peer failed"))
        self._refusals = 0
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
        return flat[flat_grads.numel()]

    def _note_refusal(self, cause: BaseException | None) -> None:
        """Count a refused attempt; stop the group at REFUSALS_BEFORE_STOP in a row."""
        if not isinstance(cause, PeerRefused):
            return
        self._refusals += 1
        self.metrics.log(
            {
                "step": self.manager.current_step() + 1,
                "replica_change": "refused",
                "reason": str(cause),
                "refusals": self._refusals,
            }
        )
        if self._refusals >= REFUSALS_BEFORE_STOP:
            raise ReplicaPeerRefused(
                f"replica group {self.group} refused {self._refusals} attempts in a row: "
                f"{cause}; stopping (the last checkpoint is intact); see who reaches the "
                "lighthouse (docs/security.md)"
            )

    def _step_failed(self, started: float, error: StepNotCommitted) -> None:
        """Note a failed attempt of the current step (started at `started`, perf_counter)."""
        self._failed.append((started, str(error)))
        # The rank's log only: the collective's raw error (gloo's, every rank's copy); the
        # console gets the event's one line once the step is done (_step_committed).
        self.log.warning(
            "step not committed by every replica group (%s): redoing it", error, extra=FILE_ONLY
        )

    def _step_committed(self, step: int) -> None:
        """`step` committed: report the recovery if it took more than one attempt."""
        if not self._failed:
            return
        started, error = self._failed[0]
        attempts = len(self._failed) + 1
        if self._lost:
            cause = _cause(error)
            self._log_lost(
                step, self._lost, cause=cause, error=error, started=started, attempts=attempts
            )
        else:
            # Every group is still there: one was slow (a rejoining group loading the live
            # state for longer than fault_tolerance.timeout_s, say), and all redid the step.
            seconds = time.perf_counter() - started
            self.metrics.log(
                {
                    "step": step,
                    "replica_change": "retried",
                    "cause": _cause(error),
                    "error": error,
                    "recovery_s": seconds,
                    "steps_lost": 0,
                    "attempts": attempts,
                    "replica_groups": self.participants,
                }
            )
            self.log.warning(
                "step %d redone by every replica group (%s): %.2fs", step, _cause(error), seconds
            )
        self._failed, self._lost = [], set()

    def _log_lost(
        self,
        step: int,
        lost: set[int],
        *,
        cause: str,
        error: str,
        started: float,
        attempts: int = 1,
    ) -> None:
        seconds = time.perf_counter() - started
        size = self.group_size
        ranks = [g * size + r for g in sorted(lost) for r in range(size)]
        self.metrics.log(
            {
                "step": step,
                "replica_change": "lost",
                "replica_groups_lost": ",".join(map(str, sorted(lost))),
                "ranks_lost": ",".join(map(str, ranks)),
                "cause": cause,
                "error": error,
                "recovery_s": seconds,
                "steps_lost": 0,
                "attempts": attempts,
                "replica_groups": self.participants,
            }
        )
        self.log.warning(
            "step %d done by replica group(s) %s without group(s) %s (%s): %.2fs, no step lost",
            step,
            list(self.members),
            sorted(lost),
            cause,
            seconds,
        )

    def close(self) -> None:
        self.manager.shutdown(wait=False)
        self._tunnels.close()


class _QuorumIds:
    """torchft's client to this group's manager server, keeping the replica ids of the last
    quorum it answered (torchft 0.2.0's Manager hands them to no one)."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self.replica_ids: tuple[str, ...] = ()

    def _quorum(self, **kwargs: Any) -> Any:
        quorum = self._client._quorum(**kwargs)
        self.replica_ids = tuple(quorum.replica_ids)
        return quorum

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


def _unproven(secret: bytes, replica_ids: Iterable[str]) -> list[str]:
    """The ids among `replica_ids` that carry no proof of `secret` (none without a secret: the
    rule table then allows only a loopback lighthouse)."""
    if not secret:
        return []
    return [i for i in replica_ids if proven_group(secret, i) is None]


def _tensors(state: dict[str, Any]) -> Iterable[torch.Tensor]:
    for value in state.values():
        if isinstance(value, dict):
            yield from _tensors(value)
        elif isinstance(value, torch.Tensor):
            yield value
