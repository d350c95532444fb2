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

The error buffers are per rank and are not checkpointed: a resume in the compressed phase starts
them from zero (one step of compression error, which the method absorbs), so such a resume is
close to, not bit-identical with, an uninterrupted run.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from distrain.parallel import comm_clock
from distrain.parallel.compress import CommStats, pack_signs, unpack_signs, wire_bytes


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
        self.world = dist.get_world_size(group) if dist.is_initialized() else 1
        self.worker_error: torch.Tensor | None = None
        self.server_error: torch.Tensor | None = None
        self.steps_taken = 0

    def compressing(self) -> bool:
        """Whether the next step is past warm-up: the trainer then keeps gradients local (no DDP
        all-reduce), since the momentum is what gets communicated."""
        return self.steps_taken >= self.freeze_step

    def _params(self) -> list[tuple[torch.nn.Parameter, dict]]:
        return [(p, g) for g in self.param_groups for p in g["params"] if p.grad is not None]

    @torch.no_grad()
    def step(self, closure: None = None) -> None:
        compressed = self.compressing()
        self.steps_taken += 1
        pairs = self._params()
        for p, group in pairs:
            state = self.state[p]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
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
        chunk = -(-n // (8 * world)) * 8  # whole bytes of packed signs per server chunk
        padded = torch.zeros(chunk * world, device=flat.device)
        padded[:n] = flat
        if self.worker_error is None:
            self.worker_error = torch.zeros_like(padded)
            self.server_error = torch.zeros(chunk, device=flat.device)
        # Worker side: compress momentum + worker error; keep what compression dropped.
        corrected = padded + self.worker_error
        scale = corrected.norm() / corrected.numel() ** 0.5
        signs, _ = pack_signs(corrected)
        self.worker_error = corrected - scale * unpack_signs(signs, corrected.numel())
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
        mine = torch.stack([scales[r] * unpack_signs(received[r], chunk) for r in range(world)])
        server = mine.mean(0) + self.server_error
        server_scale = server.norm() / chunk**0.5
        server_signs, _ = pack_signs(server)
        self.server_error = server - server_scale * unpack_signs(server_signs, chunk)
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
