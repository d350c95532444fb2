"""When to checkpoint: temporary saves (every `interval_steps` and/or `interval_minutes`, pruned
to `keep_temporary`) and permanent ones (every `permanent_every_steps` / `_minutes`, kept).

Step triggers are the same on every rank by construction. Clock triggers are decided by rank 0
and broadcast, only at logging steps (where ranks synchronize anyway), so every rank saves at the
same step and no collective is left waiting.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from distrain.config.schema import CheckpointConfig


class CheckpointPolicy:
    def __init__(self, cfg: CheckpointConfig, *, total_steps: int, device: torch.device):
        self.cfg, self.total_steps, self.device = cfg, total_steps, device
        now = time.monotonic()
        self.last_temporary = self.last_permanent = now

    def due(self, step: int, *, sync_point: bool) -> str | None:
        """ "permanent", "temporary" or None for the step just finished. Collective when
        `sync_point` (a logging step) and a clock trigger is configured."""
        c = self.cfg
        permanent = bool(c.permanent_every_steps and step % c.permanent_every_steps == 0)
        temporary = bool(c.interval_steps and step % c.interval_steps == 0)
        if step == self.total_steps and c.at_end:
            permanent = True
        if sync_point and (c.interval_minutes or c.permanent_every_minutes):
            by_clock = self._clock_due()
            temporary, permanent = temporary or by_clock[0], permanent or by_clock[1]
        if permanent:
            self.last_permanent = self.last_temporary = time.monotonic()
            return "permanent"
        if temporary:
            self.last_temporary = time.monotonic()
            return "temporary"
        return None

    def _clock_due(self) -> tuple[bool, bool]:
        now = time.monotonic()
        c = self.cfg
        flags = torch.tensor(
            [
                bool(c.interval_minutes and now - self.last_temporary >= 60 * c.interval_minutes),
                bool(
                    c.permanent_every_minutes
                    and now - self.last_permanent >= 60 * c.permanent_every_minutes
                ),
            ],
            dtype=torch.int32,
            device=self.device,
        )
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast(flags, src=0)
        return bool(flags[0]), bool(flags[1])
