"""The training side of mixture-of-experts layers: their balancing losses added to each
micro-batch's loss, the expert-bias update after each optimizer step (DeepSeek-V3's auxiliary-loss-
free balancing, from the load summed over all data-parallel ranks), and the per-logged-step
metrics. The layer (models/decoder/moe.py) holds no collectives; the all-reduces live here.
The layers come from the model family's spec (`moe_layers`); what is read of each is
`RoutedLayer`.

Every figure stays on the device between logging steps: the bias update is a device all-reduce
and a sign, and the metrics are read (one all-reduce, one host copy) only when a row is logged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn


class RoutedLayer(Protocol):
    """What is read of one MoE layer after each forward, and the bias it updates."""

    tokens_per_expert: torch.Tensor
    aux_loss: torch.Tensor
    z_loss: torch.Tensor
    dropped: torch.Tensor
    expert_bias: torch.Tensor

    def balancing_loss(self) -> torch.Tensor: ...


class MoEStats:
    """Collects the MoE layers' per-forward statistics of one rank's model parts."""

    def __init__(
        self,
        parts: list[nn.Module],
        *,
        moe_layers: Callable[[nn.Module], list[Any]],
        dp_group: dist.ProcessGroup,
        device: torch.device,
        args: Any,
    ):
        """`moe_layers`: the family's (its spec's); `args`: the model's MoE settings
        (num_experts, balance, bias_update_rate), given even to a rank whose pipeline stages
        hold no MoE layer."""
        self.moe_layers = moe_layers
        self.layers: list[RoutedLayer] = [layer for part in parts for layer in moe_layers(part)]
        self.dp_group = dp_group
        self.args = args
        self.device = device
        self._rows: dict[int, torch.Tensor] = {}
        """Per model part (a pipeline stage): the rows of its layers in `self.layers`."""
        shape = (len(self.layers), self.args.num_experts)
        self.step_load = torch.zeros(shape, dtype=torch.float64, device=device)
        """Token copies routed to each (layer, expert) in this step, on this rank."""
        self.window_load = torch.zeros(shape, dtype=torch.float64, device=device)
        """Routed copies since the last logged row: summed over data-parallel ranks already with
        balance = 'bias' (the update needs them every step), this rank's alone otherwise."""
        # aux loss sum, z loss sum, forward calls, dropped copies, routed copies
        self.window_sums = torch.zeros(5, dtype=torch.float64, device=device)

    @property
    def global_load_each_step(self) -> bool:
        return self.args.balance == "bias"

    def after_forward(self, part: nn.Module | None = None) -> torch.Tensor:
        """The balancing loss term of the forward call just made (added to its training loss),
        and that call's statistics into this step's totals. `part`: the model part that ran
        (one of several pipeline stages on this rank, each run on its own); None: all."""
        layers = self.layers if part is None else self.moe_layers(part)
        loss = sum(layer.balancing_loss() for layer in layers)
        load = torch.stack([layer.tokens_per_expert for layer in layers])
        if part is None:
            self.step_load += load
        else:
            self.step_load.index_add_(0, self._rows_of(part, layers), load.to(torch.float64))
        aux = torch.stack([layer.aux_loss.detach() for layer in layers]).mean()
        z_loss = torch.stack([layer.z_loss.detach() for layer in layers]).mean()
        dropped = torch.stack([layer.dropped for layer in layers]).sum()
        routed = sum(layer.tokens_per_expert.sum() for layer in layers)
        self.window_sums += torch.stack(
            [aux, z_loss, torch.ones_like(aux), dropped.to(aux.dtype), routed.to(aux.dtype)]
        ).double()
        return loss

    def _rows_of(self, part: nn.Module, layers: list[RoutedLayer]) -> torch.Tensor:
        if id(part) not in self._rows:
            index = {id(layer): i for i, layer in enumerate(self.layers)}
            rows = [index[id(layer)] for layer in layers]
            self._rows[id(part)] = torch.tensor(rows, device=self.device)
        return self._rows[id(part)]

    def discard_step(self) -> None:
        """Forget the forward calls made before the first step (the automatic micro-batch
        size's trials, which train nothing)."""
        self.step_load.zero_()
        self.window_sums.zero_()

    @torch.no_grad()
    def after_step(self, *, updated: bool) -> None:
        """Close the step: with balance = 'bias', all-reduce its load over the data-parallel ranks
        and move each expert's bias towards balance (up for an under-loaded expert, down for an
        over-loaded one) when the optimizer stepped."""
        load = self.step_load
        if self.global_load_each_step:
            _all_reduce(load, self.dp_group)
            if updated:
                rate = self.args.bias_update_rate
                for layer, row in zip(self.layers, load, strict=True):
                    layer.expert_bias += rate * torch.sign(row.mean() - row).float()
        self.window_load += load
        self.step_load.zero_()

    def metrics(self) -> dict[str, float]:
        """The logged row's MoE figures over the steps since the last row, all data-parallel
        ranks together; one all-reduce and one host read (a logging step only)."""
        parts = [self.window_sums]
        if not self.global_load_each_step:
            parts.append(self.window_load.flatten())
        flat = torch.cat(parts)
        _all_reduce(flat, self.dp_group)
        if not self.layers:  # a pipeline rank whose stages hold no MoE layer
            self.window_sums.zero_()
            return {}
        sums = flat[:5]
        load = flat[5:].view_as(self.window_load) if len(parts) > 1 else self.window_load
        mean = load.mean(dim=-1, keepdim=True).clamp(min=1)
        relative = load / mean
        cv = (load.std(dim=-1, correction=0) / mean.squeeze(-1)).mean()
        figures = torch.stack(
            [
                sums[0] / sums[2],
                sums[1] / sums[2],
                sums[3] / sums[4].clamp(min=1),
                relative.min(),
                relative.max(),
                cv,
            ]
        ).tolist()
        self.window_sums.zero_()
        self.window_load.zero_()
        names = (
            "moe_aux_loss",
            "moe_z_loss",
            "moe_dropped_fraction",
            "moe_load_min",
            "moe_load_max",
            "moe_load_cv",
        )
        return dict(zip(names, figures, strict=True))


def _all_reduce(t: torch.Tensor, group: dist.ProcessGroup) -> None:
    if dist.get_world_size(group) > 1:
        dist.all_reduce(t, group=group)
