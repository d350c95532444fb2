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
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from distrain.parallel import comm_clock
from distrain.parallel.compress import CommStats, pack_signs, unpack_signs, wire_bytes

_ERROR_KEYS = ("worker_error", "server_error")


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
    ):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": 0.0})
        self.freeze_step, self.group, self.stats = freeze_step, group, stats
        distributed = dist.is_initialized()
        self.world = dist.get_world_size(group) if distributed else 1
        self.rank = dist.get_rank(group) if distributed else 0
        # Flat over `_flat_params()`, zero-padded to `world` chunks; the padding carries no error.
        self.worker_error: torch.Tensor | None = None  # this rank's, the whole padded length
        self.server_error: torch.Tensor | None = None  # this rank's chunk
        self.steps_taken = 0  # a cache of state["step"], restored by load_state_dict

    def keeps_gradients_local(self) -> bool:
        """Whether the next step is past warm-up: the trainer then keeps gradients local (no DDP
        all-reduce), since the momentum is what gets communicated (`KeepsGradientsLocal`)."""
        return self.steps_taken >= self.freeze_step

    def _flat_params(self) -> list[torch.nn.Parameter]:
        return [p for g in self.param_groups for p in g["params"]]

    def _chunk(self, n: int) -> int:
        """Elements per server chunk: whole bytes of packed signs, `world` chunks cover n."""
        return -(-n // (8 * self.world)) * 8

    @torch.no_grad()
    def step(self, closure: None = None) -> None:
        compressed = self.keeps_gradients_local()
        self.steps_taken += 1
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
            state["exp_avg"].mul_(beta1).add_(p.grad, alpha=1 - beta1)
            if not compressed:
                state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
        if compressed:
            self._average_momentum([self.state[p]["exp_avg"] for p, _ in pairs])
        for p, group in pairs:
            self._update(p, group)

    def _update(self, p: torch.nn.Parameter, group: dict) -> None:
        """AdamW's update (decoupled weight decay, bias correction); v's correction stays at the
        freeze step once v is frozen."""
        state = self.state[p]
        beta1, beta2 = group["betas"]
        step = float(state["step"])
        v_steps = min(step, float(self.freeze_step)) if self.freeze_step else step
        p.mul_(1 - group["lr"] * group["weight_decay"])
        denom = (state["exp_avg_sq"] / (1 - beta2**v_steps)).sqrt_().add_(group["eps"])
        p.addcdiv_(state["exp_avg"], denom, value=-group["lr"] / (1 - beta1**step))

    def _average_momentum(self, momenta: list[torch.Tensor]) -> None:
        flat = torch.cat([m.flatten() for m in momenta]).float()
        averaged = self._compressed_allreduce(flat)
        offset = 0
        for m in momenta:
            m.copy_(averaged[offset : offset + m.numel()].view_as(m))
            offset += m.numel()

    def _compressed_allreduce(self, flat: torch.Tensor) -> torch.Tensor:
        n, world = flat.numel(), self.world
        chunk = self._chunk(n)
        if self.worker_error is None:
            self.worker_error = torch.zeros(chunk * world, device=flat.device)
            self.server_error = torch.zeros(chunk, device=flat.device)
        # Worker side: compress momentum + worker error; keep what compression dropped. Scales
        # and errors cover the n real elements only, so the padding (which depends on the
        # number of ranks) holds no state.
        corrected = self.worker_error.clone()
        corrected[:n] += flat
        scale = corrected.norm() / n**0.5
        signs, _ = pack_signs(corrected)
        self.worker_error = corrected - scale * unpack_signs(signs, corrected.numel())
        self.worker_error[n:] = 0
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
        server = mine.mean(0) + self.server_error
        server[valid:] = 0
        server_scale = server.norm() / max(valid, 1) ** 0.5
        server_signs, _ = pack_signs(server)
        self.server_error = server - server_scale * unpack_signs(server_signs, chunk)
        self.server_error[valid:] = 0
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
        errors, the same on every rank) and `worker_error.rank<r>` (this rank's). Collective
        over the data-parallel group once the error buffers exist (past warm-up)."""
        sd = super().state_dict()
        params = self._flat_params()
        n = sum(p.numel() for p in params)
        device = params[0].device
        if self.worker_error is None:
            worker = torch.zeros(n, device=device)
            server = torch.zeros(n, device=device)
        else:
            worker = self.worker_error[:n]
            server = self._gathered_server_error()[:n]
        offset = 0
        for index, p in enumerate(params):
            span = slice(offset, offset + p.numel())
            # A new dict: torch's state_dict shares the live per-parameter state dicts.
            sd["state"][index] = {
                **sd["state"].get(index, {}),
                "server_error": server[span].view_as(p),
                "worker_error": {f"rank{self.rank}": worker[span].view_as(p)},
            }
            offset += p.numel()
        return sd

    def _gathered_server_error(self) -> torch.Tensor:
        if self.world == 1:
            return self.server_error
        full = torch.empty(self.server_error.numel() * self.world, device=self.server_error.device)
        dist.all_gather_into_tensor(full, self.server_error, group=self.group)
        return full

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore the moments, the step count (and so the phase) and the error buffers."""
        super().load_state_dict(state_dict)
        params = self._flat_params()
        worker, server = [], []
        for p in params:
            state = self.state[p]
            saved = {key: state.pop(key, {}) for key in _ERROR_KEYS}
            state.update({key: {} for key in _ERROR_KEYS})
            own = saved["worker_error"].get(f"rank{self.rank}") if saved["worker_error"] else None
            worker.append(own if own is not None else torch.zeros_like(p))
            server_part = saved["server_error"]
            server.append(server_part if isinstance(server_part, torch.Tensor) else worker[-1] * 0)
        steps = [int(self.state[p]["step"]) for p in params if "step" in self.state[p]]
        self.steps_taken = max(steps, default=0)
        if not self.keeps_gradients_local():
            self.worker_error = self.server_error = None
            return
        n = sum(p.numel() for p in params)
        chunk = self._chunk(n)
        device = params[0].device
        self.worker_error = torch.zeros(chunk * self.world, device=device)
        self.worker_error[:n] = torch.cat([w.flatten().float() for w in worker])
        server_full = torch.zeros(chunk * self.world, device=device)
        server_full[:n] = torch.cat([s.flatten().float() for s in server])
        self.server_error = server_full[self.rank * chunk : (self.rank + 1) * chunk].clone()
