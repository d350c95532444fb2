"""Staging for background saves (`Stager`): a copy of the state to save, in host memory, that
the training step may overwrite as soon as the copy is taken. On CUDA the copy goes to pinned
memory (a fast device-to-host transfer); for a writer process it goes to shared memory. The
buffers are kept from one save to the next (torch's DefaultStager keeps one copy per source
storage), so many saves cost one copy's memory, not one per save (torch 2.13 and 2.14; on
2.11 each save makes its own copy, the last one freed with it: torch_compat.DefaultStager). A
shared copy holds one open file per tensor for as long as it is kept."""

from __future__ import annotations

from typing import Any

from torch.distributed.checkpoint.staging import StagingOptions
from torch.distributed.checkpoint.stateful import Stateful

from distrain.torch_compat import DefaultStager


class Stager:
    def __init__(self, *, pinned: bool, shared: bool):
        self._stager = DefaultStager(
            StagingOptions(
                use_pinned_memory=pinned,
                use_shared_memory=shared,
                # Staging is what the step waits for: it is done before save() returns.
                use_async_staging=False,
                use_non_blocking_copy=pinned,
            )
        )

    def stage(self, state: dict[str, Any]) -> dict[str, Any]:
        """A host copy of `state` (its Stateful entries by their state_dict), in the kept
        buffers: valid until the next call."""
        plain = {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in state.items()}
        return self._stager.stage(plain)

    def close(self) -> None:
        """Free the kept buffers."""
        self._stager.close()
