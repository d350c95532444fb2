"""Staging for background saves (`Stager`): a copy of the state to save, in host memory, that
the training step may overwrite as soon as the copy is taken. On CUDA the copy goes to pinned
memory (a fast device-to-host transfer); for a writer process it goes to shared memory. The
buffers are kept from one save to the next (torch's DefaultStager keeps one copy per source
storage), so many saves cost one copy's memory, not one per save."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.stateful import Stateful


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
        """A copy of `state` (its Stateful entries by their state_dict): its tensors in the kept
        host buffers, valid until the next call; every other value deep-copied."""
        plain = {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in state.items()}
        tensors: list[torch.Tensor] = []
        skeleton = _hollow(plain, tensors)
        staged = self._stager.stage(dict(enumerate(tensors)))
        return _filled(skeleton, staged)  # type: ignore[arg-type]

    def close(self) -> None:
        """Free the kept buffers."""
        self._stager.close()


@dataclass(frozen=True)
class _Slot:
    """Where the tensor numbered `index` goes back."""

    index: int


def _hollow(value: Any, tensors: list[torch.Tensor]) -> Any:
    """`value` with each tensor inside its dicts, lists and tuples replaced by a `_Slot` (the
    tensor appended to `tensors`) and everything else deep-copied: only tensors go through the
    staging buffers."""
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return _Slot(len(tensors) - 1)
    if isinstance(value, dict):
        return {k: _hollow(v, tensors) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_hollow(v, tensors) for v in value)
    return copy.deepcopy(value)


def _filled(value: Any, staged: dict[int, torch.Tensor]) -> Any:
    """`_hollow`'s skeleton with the staged tensors in their slots."""
    if isinstance(value, _Slot):
        return staged[value.index]
    if isinstance(value, dict):
        return {k: _filled(v, staged) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_filled(v, staged) for v in value)
    return value
