"""1-bit Adam (Tang et al. 2021, "1-bit Adam: Communication Efficient Large-Scale Training with
Adam's Convergence Speed"): Adam whose momentum, not its gradient, crosses the network, 1 bit per
value after a warm-up.

- Warm-up (the first `freeze_step` steps): plain AdamW on gradients that DDP all-reduced in fp32.
- Then the second moment v is frozen. Each rank folds its *local* gradient into the shared
  momentum, and the momenta are averaged by a compressed all-reduce with error compensation on
  both sides: every rank compresses (momentum + its worker error) to signs and one scale, sends
  chunk r of its signs to rank r (all-to-all); rank r, the "server" of chunk r, averages the
  chunks, adds its server error, compresses again and all-gathers the result. Both errors keep
  what compression dropped and add it back at the next step, so nothing is lost, only delayed.
Bytes each rank sends per step after warm-up: (N-1)/N x n/8 (all-to-all) + (N-1) x n/(8N)
(all-gather) + scales, against 2(N-1)/N x 4n for a ring fp32 all-reduce of n gradients: 32x fewer
whatever N (compress.wire_bytes).

Everything a resume needs is in the checkpoint, so a resume equals the uninterrupted run bit for
bit: the phase follows from the saved step count, and the error buffers are saved per parameter
next to the moments. The server errors (rank r's covers chunk r of the flat momentum) are
gathered into one value per parameter, the same on every rank and valid under any number of
ranks; the worker errors are each rank's own, saved as `worker_error.rank<r>`, so they resume on
the same number of data-parallel ranks.

Under tensor and pipeline parallelism (`averages_gradients`: no DDP/FSDP2 wrapper) each rank
holds local shards of DTensor parameters, or its stages' parameters, and its data-parallel group
is the dp ranks with the same tp and pp coordinates. The optimizer then averages the local
gradients itself in warm-up (an fp32 all-reduce per unit) and works on local tensors throughout.
Values that several groups hold alike must take the same step in each: a parameter replicated
over tp, and the two copies of an embedding tied across the first and last stage. Compression is
not elementwise (one scale per chunk), so the parameters are cut into `units` (`onebit_units`),
each compressed on its own, and a unit holds either only such shared values, the same on each of
their holders, or none: the holders then compress identical inputs into identical steps.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from distrain.parallel import comm_clock
from distrain.parallel.compress import CommStats, pack_signs, unpack_signs, wire_bytes
from distrain.parallel.local import copy_from_flat, local_tensor

_ERROR_KEYS = ("worker_error", "server_error")


def _like(values: torch.Tensor, p: torch.nn.Parameter) -> torch.Tensor:
    """`values` (this rank's, flat) in `p`'s shape and kind: a DTensor laid out as `p` is."""
    if isinstance(p, DTensor):
        local = values.view_as(p.to_local())
        return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False)
    return values.view_as(p)


def onebit_units(
    named: list[tuple[str, nn.Parameter]], tied: Callable[[str], bool]
) -> list[list[nn.Parameter]]:
    """The compression units of `named` (parameter order kept within each): the parameters
    whose name `tied` marks (an embedding tied across pipeline stages: each stage holding a copy
    has this unit alone), the DTensor parameters replicated over their mesh (the same on every
    tp rank), and the rest. Without tp and pp, one unit."""
    tied_unit = [p for name, p in named if tied(name)]
    replicated = [
        p
        for name, p in named
        if not tied(name)
        and isinstance(p, DTensor)
        and all(placement.is_replicate() for placement in p.placements)
    ]
    taken = {id(p) for p in tied_unit + replicated}
    rest = [p for _, p in named if id(p) not in taken]
    return [unit for unit in (tied_unit, replicated, rest) if unit]


class OneBitAdam(torch.optim.Optimizer):
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
        units: list[list[nn.Parameter]] | None = None,
        averages_gradients: bool = False,
    ):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": 0.0})
        self.freeze_step, self.group, self.stats = freeze_step, group, stats
        distributed = dist.is_initialized()
        self.world = dist.get_world_size(group) if distributed else 1
        self.rank = dist.get_rank(group) if distributed else 0
        self.averages_gradients = averages_gradients
        """No wrapper (tp, pp): the optimizer averages the warm-up's gradients itself
        (`OneBitAdamPlan.before_clip`)."""
        self.units = units if units is not None else [self._flat_params()]
        """Parameters compressed together (`onebit_units`); a partition of the parameters."""
        assert sorted(id(p) for u in self.units for p in u) == sorted(
            id(p) for p in self._flat_params()
        ), "units must partition the parameters"
        # Per unit, flat over its local values, zero-padded to `world` chunks; the padding
        # carries no error.
        self.worker_error: list[torch.Tensor] | None = None  # this rank's, the padded length
        self.server_error: list[torch.Tensor] | None = None  # this rank's chunk
        self.steps_taken = 0  # a cache of state["step"], restored by load_state_dict

    def keeps_gradients_local(self) -> bool:
        """Whether the next step is past warm-up under DDP: the trainer then keeps gradients
        local (no DDP all-reduce), since the momentum is what gets communicated
        (`OneBitAdamPlan.sync_in_backward`). Without a wrapper (`averages_gradients`) there is
        no all-reduce to skip, and the norm that clips a replica's gradient stays global: the
        root mean square of the replicas' norms, since a replica spans its tp and pp ranks."""
        return self._compressed() and not self.averages_gradients

    def _compressed(self) -> bool:
        """The next step is past warm-up: the momentum crosses the network, compressed."""
        return self.steps_taken >= self.freeze_step

    def _flat_params(self) -> list[torch.nn.Parameter]:
        return [p for g in self.param_groups for p in g["params"]]

    def _chunk(self, n: int) -> int:
        """Elements per server chunk: whole bytes of packed signs, `world` chunks cover n."""
        return -(-n // (8 * self.world)) * 8

    @torch.no_grad()
    def average_gradients(self) -> None:
        """Warm-up without a wrapper: bring each DTensor gradient to its parameter's layout and
        average the local gradients over the data-parallel group, one fp32 all-reduce per unit
        (counted), as DDP would have. Past warm-up the gradients stay local."""
        self._align_gradients()
        if self.world == 1 or self._compressed():
            return
        for unit in self.units:
            grads = [local_tensor(p.grad) for p in unit if p.grad is not None]
            if not grads:
                continue
            flat = torch.cat([g.reshape(-1).float() for g in grads])
            mark = comm_clock.start(flat.device)
            dist.all_reduce(flat, group=self.group)
            mark.stop()
            self._count(wire_bytes("all_reduce", flat.nbytes, self.world), flat.numel(), mark)
            flat /= self.world
            copy_from_flat(flat, grads)

    def _align_gradients(self) -> None:
        """DTensor gradients in their parameter's placements (under tp some arrive Replicate or
        Partial), so that local gradient and local parameter hold the same values."""
        for p in self._flat_params():
            grad = p.grad
            if isinstance(grad, DTensor) and grad.placements != p.placements:
                p.grad = grad.redistribute(placements=p.placements)

    @torch.no_grad()
    def step(self, closure: None = None) -> None:
        compressed = self._compressed()
        self.steps_taken += 1
        self._align_gradients()
        pairs = [(p, g) for g in self.param_groups for p in g["params"] if p.grad is not None]
        if compressed and len(pairs) != len(self._flat_params()):
            raise RuntimeError(
                "1-bit Adam past its warm-up exchanges the momentum of every parameter; "
                "a parameter got no gradient this step"
            )
        for p, group in pairs:
            state = self.state[p]
            if "step" not in state:
                # A literal, not zeros(): fake tensor mode keeps a literal's value, so the
                # planner's fake step can read it.
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
                # Names only (filled by state_dict): torch's flattened optimizer state dicts
                # carry just the state names a parameter already has.
                state.update({key: {} for key in _ERROR_KEYS})
            beta1, beta2 = group["betas"]
            state["step"] += 1
            grad, exp_avg = local_tensor(p.grad), local_tensor(state["exp_avg"])
            exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
            if not compressed:
                local_tensor(state["exp_avg_sq"]).mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        if compressed:
            self._average_momentum()
        for p, group in pairs:
            self._update(p, group)

    def _update(self, p: torch.nn.Parameter, group: dict) -> None:
        """AdamW's update (decoupled weight decay, bias correction); v's correction stays at the
        freeze step once v is frozen."""
        state = self.state[p]
        beta1, beta2 = group["betas"]
        step = float(state["step"])
        v_steps = min(step, float(self.freeze_step)) if self.freeze_step else step
        param = local_tensor(p)
        param.mul_(1 - group["lr"] * group["weight_decay"])
        denom = (
            (local_tensor(state["exp_avg_sq"]) / (1 - beta2**v_steps)).sqrt_().add_(group["eps"])
        )
        param.addcdiv_(
            local_tensor(state["exp_avg"]), denom, value=-group["lr"] / (1 - beta1**step)
        )

    def _average_momentum(self) -> None:
        if self.worker_error is None:
            self.worker_error, self.server_error = [], []
            for unit in self.units:
                n = sum(local_tensor(p).numel() for p in unit)
                device = local_tensor(unit[0]).device
                self.worker_error.append(torch.zeros(self._chunk(n) * self.world, device=device))
                self.server_error.append(torch.zeros(self._chunk(n), device=device))
        for index, unit in enumerate(self.units):
            momenta = [local_tensor(self.state[p]["exp_avg"]) for p in unit]
            flat = torch.cat([m.flatten() for m in momenta]).float()
            copy_from_flat(self._compressed_allreduce(flat, index), momenta)

    def _compressed_allreduce(self, flat: torch.Tensor, unit: int) -> torch.Tensor:
        n, world = flat.numel(), self.world
        chunk = self._chunk(n)
        assert self.worker_error is not None and self.server_error is not None
        # Worker side: compress momentum + worker error; keep what compression dropped. Scales
        # and errors cover the n real elements only, so the padding (which depends on the
        # number of ranks) holds no state.
        corrected = self.worker_error[unit].clone()
        corrected[:n] += flat
        scale = corrected.norm() / n**0.5
        signs, _ = pack_signs(corrected)
        worker_error = corrected - scale * unpack_signs(signs, corrected.numel())
        worker_error[n:] = 0
        self.worker_error[unit] = worker_error
        if world == 1:
            received, scales = signs.view(1, -1), scale.view(1)
        else:
            mark = comm_clock.start(flat.device)
            received = torch.empty_like(signs)
            dist.all_to_all_single(received, signs, group=self.group)
            scales = torch.empty(world, device=flat.device)
            dist.all_gather_into_tensor(scales, scale.view(1).float(), group=self.group)
            mark.stop()
            sent = wire_bytes("all_to_all", signs.nbytes, world)
            self._count(sent + wire_bytes("all_gather", scale.element_size(), world), n, mark)
            received = received.view(world, -1)
        # Server side: average this rank's chunk over workers, add the server error, compress.
        valid = min(max(n - self.rank * chunk, 0), chunk)
        mine = torch.stack([scales[r] * unpack_signs(received[r], chunk) for r in range(world)])
        server = mine.mean(0) + self.server_error[unit]
        server[valid:] = 0
        server_scale = server.norm() / max(valid, 1) ** 0.5
        server_signs, _ = pack_signs(server)
        server_error = server - server_scale * unpack_signs(server_signs, chunk)
        server_error[valid:] = 0
        self.server_error[unit] = server_error
        if world == 1:
            all_signs, all_scales = server_signs.view(1, -1), server_scale.view(1)
        else:
            mark = comm_clock.start(flat.device)
            all_signs = torch.empty(
                world * server_signs.numel(), dtype=torch.uint8, device=flat.device
            )
            dist.all_gather_into_tensor(all_signs, server_signs, group=self.group)
            all_scales = torch.empty(world, device=flat.device)
            dist.all_gather_into_tensor(all_scales, server_scale.view(1).float(), group=self.group)
            mark.stop()
            sent = server_signs.nbytes + server_scale.element_size()
            self._count(wire_bytes("all_gather", sent, world), 0, mark)
            all_signs = all_signs.view(world, -1)
        full = torch.cat([all_scales[r] * unpack_signs(all_signs[r], chunk) for r in range(world)])
        return full[:n]

    def _count(self, wire: float, fp32_values: int, mark: comm_clock.CommMark) -> None:
        if self.stats is not None:
            self.stats.add_completed(
                wire, fp32_values=fp32_values, group_size=self.world, mark=mark
            )

    # --- checkpointing -----------------------------------------------------------------------

    def state_dict(self) -> dict:
        """torch's optimizer state plus, per parameter, `server_error` (the gathered server
        errors, the same on every rank of the group) and `worker_error.rank<r>` (this rank's),
        laid out as the parameter (DTensors under tp). Collective over the data-parallel group
        once the error buffers exist (past warm-up)."""
        sd = super().state_dict()
        index_of = {id(p): i for i, p in enumerate(self._flat_params())}
        for unit_index, unit in enumerate(self.units):
            n = sum(local_tensor(p).numel() for p in unit)
            if self.worker_error is None:
                # Two tensors: a checkpoint load writes into these in place.
                device = local_tensor(unit[0]).device
                worker, server = torch.zeros(n, device=device), torch.zeros(n, device=device)
            else:
                worker = self.worker_error[unit_index][:n]
                server = self._gathered_server_error(unit_index)[:n]
            offset = 0
            for p in unit:
                index, size = index_of[id(p)], local_tensor(p).numel()
                span = slice(offset, offset + size)
                # A new dict: torch's state_dict shares the live per-parameter state dicts.
                sd["state"][index] = {
                    **sd["state"].get(index, {}),
                    "server_error": _like(server[span], p),
                    "worker_error": {f"rank{self.rank}": _like(worker[span], p)},
                }
                offset += size
        return sd

    def _gathered_server_error(self, unit: int) -> torch.Tensor:
        assert self.server_error is not None
        mine = self.server_error[unit]
        if self.world == 1:
            return mine
        full = torch.empty(mine.numel() * self.world, device=mine.device)
        dist.all_gather_into_tensor(full, mine, group=self.group)
        return full

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore the moments, the step count (and so the phase) and the error buffers."""
        super().load_state_dict(state_dict)
        worker, server = {}, {}
        for p in self._flat_params():
            state = self.state[p]
            saved = {key: state.pop(key, {}) for key in _ERROR_KEYS}
            state.update({key: {} for key in _ERROR_KEYS})
            own = saved["worker_error"].get(f"rank{self.rank}") if saved["worker_error"] else None
            worker[id(p)] = (
                local_tensor(own) if own is not None else torch.zeros_like(local_tensor(p))
            )
            server_part = saved["server_error"]
            server[id(p)] = (
                local_tensor(server_part)
                if isinstance(server_part, torch.Tensor)
                else torch.zeros_like(local_tensor(p))
            )
        steps = [int(self.state[p]["step"]) for p in self._flat_params() if "step" in self.state[p]]
        self.steps_taken = max(steps, default=0)
        if not self._compressed():
            self.worker_error = self.server_error = None
            return
        self.worker_error, self.server_error = [], []
        for unit in self.units:
            n = sum(local_tensor(p).numel() for p in unit)
            chunk = self._chunk(n)
            device = local_tensor(unit[0]).device
            worker_full = torch.zeros(chunk * self.world, device=device)
            worker_full[:n] = torch.cat([worker[id(p)].flatten().float() for p in unit])
            server_full = torch.zeros(chunk * self.world, device=device)
            server_full[:n] = torch.cat([server[id(p)].flatten().float() for p in unit])
            self.worker_error.append(worker_full)
            self.server_error.append(
                server_full[self.rank * chunk : (self.rank + 1) * chunk].clone()
            )
