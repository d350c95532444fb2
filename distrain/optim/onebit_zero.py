"""1-bit Adam under ZeRO-1 and ZeRO-2: the Adam state (and under ZeRO-2 the averaged gradient)
sharded over the data-parallel ranks, the exchange compressed to 1 bit per value after the
warm-up (DeepSpeed's 1-bit optimizers refuse ZeRO).

The parameters are seen as one flat vector of n values cut into `world` chunks of whole
blocks (`compress.onebit_blocks`); rank r owns chunk r: its momentum, its variance and its
server error. Each parameter stays whole and replicated on every rank (ZeRO-1).

- Warm-up (the first `freeze_step` steps): exactly sharded AdamW. The gradients arrive
  averaged in fp32 (the trainer's DDP all-reduce), the owner updates its chunk with AdamW's
  math and the chunks are all-gathered into every replica: the same numbers as plain AdamW.
- Then the variance is frozen and gradients stay local. At the first such step the frozen
  variance is all-gathered once (fp32), so every rank holds Adam's denominator for every value.
  Each rank compresses (its gradient + its worker error) to signs and one scale per block and
  sends chunk r to rank r (all-to-all); the owner averages what it received into its exact
  momentum, compresses that momentum (+ its server error) to signs and scales and all-gathers
  it. Every rank, the owner included, divides the same decoded momentum by the denominator and
  applies it, so the replicas stay identical and each value keeps Adam's own scale. Both errors
  keep what compression dropped and add it back at the next step: delayed, not lost. Weight
  decay is applied exactly on every rank (it only needs the replicated parameter). Bytes each
  rank sends per step: 2(N-1)/N x n/8 plus 4 bytes per block against a ring fp32 all-reduce's
  2(N-1)/N x 4n, ~32x fewer whatever N. The warm-up's parameter all-gather is not counted.

ZeRO-2 (`shard_gradients`): the model has no DDP/FSDP2 wrapper, so backward leaves each rank's
local gradient. In warm-up `reduce_and_clip` reduce-scatters them (fp32, one flat buffer,
averaged) to the owners and frees them: past the exchange a rank holds only its chunk of the
averaged gradient (1/N of the gradient bytes, and no DDP bucket), clipped by the global norm
from the owners' chunk norms (one scalar all-reduce). Both the reduce-scatter and the parameter
all-gather are counted here: together an fp32 all-reduce's bytes. Past warm-up: the compressed
path above, each local gradient freed once compressed.

Checkpoints (`state_dict`): per parameter its whole `exp_avg`, `exp_avg_sq` and `server_error`,
all-gathered from the owners (the same on every rank, so any number of ranks loads them, each
taking its chunk), and `worker_error.rank<r>`, each rank's own (a resume on fewer ranks drops the
extra ranks' one-step errors; one on more ranks finds no entry for the new ones, untested). No
tensor of the step is read on the host.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from distrain.parallel import comm_clock
from distrain.parallel.compress import (
    CommStats,
    _decode_rows,
    _with_scale,
    onebit_blocks,
    onebit_compress,
    wire_bytes,
)
from distrain.parallel.grad_norm import clip_coefficient, clip_grad_norm
from distrain.torch_compat import all_gather_single, reduce_scatter_single

_ERROR_KEYS = ("worker_error", "server_error")
_MISSING_GRADIENT = "1-bit Adam under ZeRO updates every parameter; a parameter got no gradient"
_MOMENTS = ("exp_avg", "exp_avg_sq")


class OneBitZeroAdam(torch.optim.Optimizer):
    def __init__(
        self,
        params: list[dict],
        *,
        lr: float,
        betas: tuple[float, float],
        eps: float,
        freeze_step: int,
        group: dist.ProcessGroup | None,
        stats: CommStats | None = None,
        shard_gradients: bool = False,
    ):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": 0.0})
        self.freeze_step, self.group, self.stats = freeze_step, group, stats
        self.shards_gradients = shard_gradients
        """ZeRO-2: the optimizer averages the local gradients in warm-up too (`reduce_and_clip`)."""
        self._owned: torch.Tensor | None = None
        """ZeRO-2 warm-up: this rank's chunk of the averaged, clipped gradient, until the step."""
        distributed = group is not None and dist.is_initialized()
        self.world = dist.get_world_size(group) if distributed else 1
        self.rank = dist.get_rank(group) if distributed else 0
        self._params = [p for g in self.param_groups for p in g["params"]]
        self.numel = sum(p.numel() for p in self._params)
        self.blocks, self.block = onebit_blocks(self.numel, self.world)
        self.chunk = self.blocks * self.block
        self.start = self.rank * self.chunk
        self.valid = min(max(self.numel - self.start, 0), self.chunk)
        """Values of this rank's chunk that are parameters (the rest is padding)."""
        device = self._params[0].device
        self.exp_avg = torch.zeros(self.chunk, device=device)
        self.exp_avg_sq = torch.zeros(self.chunk, device=device)
        self.server_error = torch.zeros(self.chunk, device=device)
        self.worker_error = torch.zeros(self.world * self.chunk, device=device)
        self.steps_taken = 0
        self.frozen_denom: torch.Tensor | None = None
        """Past warm-up: Adam's denominator for every value (`_gather_frozen_denominator`)."""
        self._weight_decay: torch.Tensor | None = None
        for p in self._params:
            self._name_state(p)

    def keeps_gradients_local(self) -> bool:
        """Past warm-up the trainer leaves the gradients local: they cross the network here,
        compressed (`OneBitZeroPlan.sync_in_backward`)."""
        return self.steps_taken >= self.freeze_step

    def _name_state(self, p: torch.nn.Parameter) -> None:
        """The per-parameter state torch's flattened state dicts look for: the step, and the
        names (only: the values live flat, filled by `state_dict`) of what a checkpoint holds,
        since torch loads just the names a parameter's state already has. Named once, at
        construction and after a load; the step here is not kept current (`state_dict` writes
        `steps_taken`). A state present from the start also spares torch's state-dict helpers
        the zero-gradient step they run on an optimizer without state."""
        self.state[p]["step"] = torch.tensor(float(self.steps_taken))
        self.state[p].update({key: {} for key in (*_MOMENTS, *_ERROR_KEYS)})

    def _padded(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        flat = torch.cat([t.reshape(-1).float() for t in tensors])
        return torch.nn.functional.pad(flat, (0, self.world * self.chunk - self.numel))

    def _mine(self, full: torch.Tensor) -> torch.Tensor:
        return full[self.start : self.start + self.chunk]

    def _decay(self) -> torch.Tensor:
        """lr x weight decay per value of this rank's chunk (groups differ in weight decay; the
        trainer sets one lr on all)."""
        if self._weight_decay is None:
            rates = [
                torch.full((p.numel(),), g["weight_decay"], device=p.device)
                for g in self.param_groups
                for p in g["params"]
            ]
            self._weight_decay = self._mine(self._padded(rates)).clone()
        return self._weight_decay * self.param_groups[0]["lr"]

    @torch.no_grad()
    def reduce_and_clip(self, max_norm: float) -> torch.Tensor:
        """ZeRO-2: clip to `max_norm` (math.inf: measure only) and return the gradient norm (a
        device tensor, no host sync). In warm-up the local gradients are first reduce-scattered
        to their owners and freed; the norm, the same on every rank, sums the owners' chunk
        norms. Past it each rank clips its own local gradient, as under ZeRO-1."""
        if self.keeps_gradients_local():
            return clip_grad_norm(self._params, max_norm, holders=1, local=True)
        self._owned = self._reduce_scatter()
        total_sq = self._owned.pow(2).sum()
        if self.world > 1:
            dist.all_reduce(total_sq, group=self.group)
        total = total_sq.sqrt()
        if max_norm != math.inf:
            self._owned.mul_(clip_coefficient(total, max_norm))
        return total

    def _reduce_scatter(self) -> torch.Tensor:
        """This rank's chunk of the gradient averaged in fp32 over the ranks; the local
        gradients are freed as they are copied into the flat buffer, so that the two together
        hold about one gradient's bytes."""
        if any(p.grad is None for p in self._params):
            raise RuntimeError(_MISSING_GRADIENT)
        flat = torch.zeros(self.world * self.chunk, device=self._params[0].device)
        offset = 0
        for p in self._params:
            flat[offset : offset + p.numel()].copy_(p.grad.reshape(-1))
            offset += p.numel()
            p.grad = None
        mine = torch.empty(self.chunk, device=flat.device)
        mark = comm_clock.start(flat.device)
        if self.world == 1:
            mine.copy_(flat)
        else:
            reduce_scatter_single(mine, flat, group=self.group)
        mark.stop()
        self._count(wire_bytes("reduce_scatter", flat.nbytes, self.world), self.numel, mark)
        return mine.div_(self.world)

    @torch.no_grad()
    def step(self, closure: None = None) -> None:
        if self._owned is None and any(p.grad is None for p in self._params):
            raise RuntimeError(_MISSING_GRADIENT)
        compressed = self.keeps_gradients_local()
        self.steps_taken += 1
        beta1, beta2 = self.param_groups[0]["betas"]
        eps, lr = self.param_groups[0]["eps"], self.param_groups[0]["lr"]
        step = self.steps_taken
        v_steps = min(step, self.freeze_step) if self.freeze_step else step
        if compressed:
            grad = self._exchange_gradients()
        else:
            if self.shards_gradients:
                grad = self._owned if self._owned is not None else self._reduce_scatter()
                self._owned = None
            else:
                grad = self._mine(self._padded([p.grad for p in self._params]))
            self.exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        self.exp_avg.lerp_(grad, 1 - beta1)
        if compressed:
            if self.frozen_denom is None:
                self.frozen_denom = self._gather_frozen_denominator()
            momentum = self._exchange_momentum()
            self._apply(momentum / self.frozen_denom * (-lr / (1 - beta1**step)), decay=True)
        else:
            denom = (self.exp_avg_sq.sqrt() / (1 - beta2**v_steps) ** 0.5).add_(eps)
            update = self.exp_avg / denom * (-lr / (1 - beta1**step))
            mine = self._mine(self._padded(list(self._params)))
            mine.mul_(1 - self._decay()).add_(update)
            self._apply(self._gather_parameters(mine), decay=False)

    def _apply(self, full: torch.Tensor, *, decay: bool) -> None:
        """Write the gathered flat vector into the parameters: their new values (warm-up), or
        the decoded step to add after the exact weight decay."""
        offset = 0
        for g in self.param_groups:
            for p in g["params"]:
                values = full[offset : offset + p.numel()].view_as(p)
                offset += p.numel()
                if decay:
                    p.mul_(1 - g["lr"] * g["weight_decay"]).add_(values)
                else:
                    p.copy_(values)

    def _gather_parameters(self, mine: torch.Tensor) -> torch.Tensor:
        """The warm-up's updated chunks, all-gathered; counted under ZeRO-2, where with the
        gradients' reduce-scatter it stands for DDP's all-reduce."""
        if not self.shards_gradients:
            return self._all_gather(mine)
        return self._counted_all_gather(mine)

    def _all_gather(self, mine: torch.Tensor) -> torch.Tensor:
        if self.world == 1:
            return mine
        full = torch.empty(self.world * mine.numel(), dtype=mine.dtype, device=mine.device)
        all_gather_single(full, mine.contiguous(), group=self.group)
        return full

    def _counted_all_gather(self, mine: torch.Tensor) -> torch.Tensor:
        """`_all_gather`, timed and counted in the communication statistics."""
        mark = comm_clock.start(mine.device)
        full = self._all_gather(mine)
        mark.stop()
        self._count(wire_bytes("all_gather", mine.nbytes, self.world), 0, mark)
        return full

    def _exchange_gradients(self) -> torch.Tensor:
        """This rank's chunk of the gradient averaged over the ranks, each rank's gradient sent
        as signs + a scale per block with its worker error."""
        padded = self._padded([p.grad for p in self._params]).view(-1, self.block)
        packed, scales, self.worker_error = onebit_compress(
            padded, self.worker_error, valid=self.numel
        )
        self.worker_error = self.worker_error.view(-1)
        if self.shards_gradients:
            for p in self._params:
                p.grad = None
        send = _with_scale(packed, scales).view(-1)
        mark = comm_clock.start(send.device)
        received = torch.empty_like(send)
        if self.world == 1:
            received.copy_(send)
        else:
            dist.all_to_all_single(received, send, group=self.group)
        mark.stop()
        self._count(wire_bytes("all_to_all", send.nbytes, self.world), self.numel, mark)
        rows = received.view(self.world * self.blocks, -1)
        return _decode_rows(rows, self.block).view(self.world, -1).mean(0)

    def _gather_frozen_denominator(self) -> torch.Tensor:
        """Adam's denominator from the frozen variance, whole on every rank: once, at the first
        compressed step (after a resume too), so that each rank scales the decoded momentum per
        value as Adam does. An fp32 all-gather of the variance chunks, counted."""
        variance = self._counted_all_gather(self.exp_avg_sq)
        beta2, eps = self.param_groups[0]["betas"][1], self.param_groups[0]["eps"]
        correction = (1 - beta2 ** max(self.freeze_step, 1)) ** 0.5
        return (variance.sqrt() / correction).add_(eps)

    def _exchange_momentum(self) -> torch.Tensor:
        """Every rank's chunk of the momentum, compressed by its owner with the server error
        (the owner keeps its exact momentum); the same decoded flat vector on every rank."""
        signs, scales, self.server_error = onebit_compress(
            self.exp_avg.view(self.blocks, self.block), self.server_error, valid=self.valid
        )
        self.server_error = self.server_error.view(-1)
        gathered = self._counted_all_gather(_with_scale(signs, scales).view(-1))
        rows = gathered.view(self.world * self.blocks, -1)
        return _decode_rows(rows, self.block).view(-1)

    def _count(self, wire: float, fp32_values: int, mark: comm_clock.CommMark) -> None:
        if self.stats is not None and self.world > 1:
            self.stats.add_completed(
                wire, fp32_values=fp32_values, group_size=self.world, mark=mark
            )

    def owned_gradients(self) -> dict[int, torch.Tensor]:
        """ZeRO-2 between `reduce_and_clip` and the step: by id of each parameter that this
        rank's chunk covers, the part of its averaged gradient held here (a view)."""
        if self._owned is None:
            return {}
        found, offset = {}, 0
        for p in self._params:
            low, high = max(offset, self.start), min(offset + p.numel(), self.start + self.chunk)
            if low < high:
                found[id(p)] = self._owned[low - self.start : high - self.start]
            offset += p.numel()
        return found

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._owned = None  # a skipped step (non-finite norm) leaves its chunk here
        for p in self._params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    # --- checkpointing -----------------------------------------------------------------------

    def state_dict(self) -> dict:
        """torch's layout plus, per parameter, the whole moments and server error (gathered
        from the owners: a collective over the group) and this rank's worker error."""
        sd = super().state_dict()
        gathered = {
            key: self._all_gather(getattr(self, key))[: self.numel]
            for key in (*_MOMENTS, "server_error")
        }
        worker = self.worker_error[: self.numel]
        offset = 0
        for index, p in enumerate(self._params):
            span = slice(offset, offset + p.numel())
            offset += p.numel()
            sd["state"][index] = {
                "step": torch.tensor(float(self.steps_taken)),
                **{key: value[span].view_as(p).clone() for key, value in gathered.items()},
                "worker_error": {f"rank{self.rank}": worker[span].view_as(p).clone()},
            }
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore the step count (and so the phase), this rank's chunk of the moments and the
        server error, and this rank's worker error (zero if the checkpoint has none)."""
        super().load_state_dict(state_dict)
        saved: dict[str, list[torch.Tensor]] = {key: [] for key in (*_MOMENTS, *_ERROR_KEYS)}
        steps = []
        for p in self._params:
            state = self.state[p]
            steps.append(int(state["step"]))
            for key in (*_MOMENTS, "server_error"):
                saved[key].append(state.pop(key, torch.zeros_like(p)))
            own = (state.pop("worker_error", None) or {}).get(f"rank{self.rank}")
            saved["worker_error"].append(own if own is not None else torch.zeros_like(p))
        self.steps_taken = max(steps, default=0)
        self.frozen_denom = None
        for p in self._params:
            self._name_state(p)
        for key in (*_MOMENTS, "server_error"):
            setattr(self, key, self._mine(self._padded(saved[key])).clone())
        self.worker_error = self._padded(saved["worker_error"])
