"""fp16 loss scaling that every rank of every layout agrees on.

torch's GradScaler decides from the gradients a rank holds whether a step overflowed. Under
FSDP2 (ZeRO 2/3), tp or pp each rank holds only a shard or a stage of the gradients, so an inf
in one shard would make that rank skip its step and halve its scale while the others update
theirs: the replicas drift apart and the scales disagree. `AgreedGradScaler` unscales the local
part of each gradient (DTensor shards included) and then takes the maximum of the found-inf flag
over all ranks (dp, tp and pp) before any rank decides, so every rank skips the same steps and
keeps the same scale. It is torch's `ShardedGradScaler` idea, written against the local tensors
because FSDP2 and tp gradients are DTensors.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch.amp.grad_scaler import _MultiDeviceReplicator
from torch.distributed.tensor import DTensor


class AgreedGradScaler(torch.amp.GradScaler):
    """A GradScaler whose found-inf flag is the maximum over `group` (default: all ranks)."""

    def __init__(
        self,
        device: torch.device,
        *,
        enabled: bool,
        group: dist.ProcessGroup | None = None,
        init_scale: float = 2.0**16,
    ):
        super().__init__(device.type, enabled=enabled, init_scale=init_scale)
        self.group = group
        if enabled:
            # GradScaler creates its scale at the first scale(loss); under pp only the last
            # stage computes a loss, but every rank unscales and agrees, so create it here.
            self.scale(torch.ones((), device=device))

    def _unscale_grads_(
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        allow_fp16: bool,
    ) -> dict[torch.device, torch.Tensor]:
        per_device_inv_scale = _MultiDeviceReplicator(inv_scale)
        per_device_found_inf = _MultiDeviceReplicator(found_inf)
        grouped: dict[torch.device, dict[torch.dtype, list[torch.Tensor]]] = defaultdict(
            lambda: defaultdict(list)
        )
        with torch.no_grad():
            for group in optimizer.param_groups:
                for param in group["params"]:
                    if param.grad is None:
                        continue
                    grad = param.grad
                    local = grad.to_local() if isinstance(grad, DTensor) else grad
                    if not allow_fp16 and local.dtype == torch.float16:
                        raise ValueError("Attempting to unscale FP16 gradients.")
                    grouped[local.device][local.dtype].append(local)
            for device, per_dtype in grouped.items():
                for grads in per_dtype.values():
                    torch._amp_foreach_non_finite_check_and_unscale_(
                        grads, per_device_found_inf.get(device), per_device_inv_scale.get(device)
                    )
        if not per_device_found_inf._per_device_tensors:
            # A rank without gradients for this optimizer still joins the agreement.
            per_device_found_inf.get(found_inf.device)
        return per_device_found_inf._per_device_tensors

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Unscale this rank's gradients, then agree on the found-inf flag with every rank of
        `group` (one small all-reduce per device; no host sync)."""
        if not self.is_enabled():
            return
        super().unscale_(optimizer)
        if not dist.is_initialized() or dist.get_world_size(self.group) == 1:
            return
        for flag in self._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
