"""Each parameter of a family model as the planner prices it (`ParameterTable`): its shape, the
dim tensor parallelism splits, whether it is a routed expert's weight, whether the optimizer
decays it, and which names share one tensor; read from one build of the model on the meta
device, or from the build store, where that build is kept (`load`).

The memory model prices thousands of layouts from this table (memory_model.py), and the
communication advice counts PowerSGD's matrices from it (comm_advice.py). A 7B meta build
costs most of a warm plan (it imports torch's tensor-parallel styles and, through torch's
Python kernels of `normal_` and `arange`, dynamo), so a plan reads the table kept on disk.

The stored table is data another process could have written: it is read as JSON of at most
MAX_STORED_BYTES, every entry checked for its kinds and bounds (a name, a shape of at most
MAX_DIMS non-negative integers, a tp dim inside it or none, flags that are booleans), and
anything else is a miss, built again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from distrain.family.spec import FamilyModel
from distrain.optim.param_groups import param_groups, roles_of
from distrain.plan.build_store import BuildStore

MAX_STORED_BYTES = 4 * 2**20
"""A table is about 100 bytes a parameter tensor: 40,000 tensors fit."""
MAX_DIMS = 8
MAX_NAME = 512


@dataclass(frozen=True)
class ParameterShape:
    name: str
    shape: tuple[int, ...]
    identity: int
    """The same for every name of one tensor (a tied head's and the embedding's)."""
    tp_dim: int | None
    """The dim tensor parallelism splits (None: replicated over tp)."""
    expert: bool
    """A routed expert's weight (split over ep, its FSDP2 shards over the rest)."""
    decayed: bool
    """In the optimizer's weight-decay group (optim/builder.py's `param_groups`)."""


@dataclass(frozen=True)
class ParameterTable:
    """Every parameter of one model, a tied one under each of its names, in the model's order."""

    parameters: tuple[ParameterShape, ...]

    MAX_STORED_BYTES = MAX_STORED_BYTES

    def unique(self) -> list[ParameterShape]:
        """Each tensor once, under its first name (as `nn.Module.parameters` yields them)."""
        seen: set[int] = set()
        kept = []
        for p in self.parameters:
            if p.identity not in seen:
                seen.add(p.identity)
                kept.append(p)
        return kept

    def to_stored(self) -> dict[str, Any]:
        return {
            "parameters": [
                [p.name, list(p.shape), p.identity, p.tp_dim, p.expert, p.decayed]
                for p in self.parameters
            ]
        }

    @classmethod
    def from_stored(cls, data: Any) -> ParameterTable:
        """The table `data` (JSON) holds; ValueError when it is not one (module docstring)."""
        if not isinstance(data, dict) or set(data) != {"parameters"}:
            raise ValueError("not a parameter table")
        entries = data["parameters"]
        if not isinstance(entries, list):
            raise ValueError("a parameter table's parameters are not a list")
        return cls(tuple(_entry(e) for e in entries))


def _entry(entry: Any) -> ParameterShape:
    if not isinstance(entry, list) or len(entry) != 6:
        raise ValueError("a parameter entry is not [name, shape, identity, tp, expert, decayed]")
    name, shape, identity, tp_dim, expert, decayed = entry
    if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME:
        raise ValueError("a parameter's name is not a string of 1 to 512 characters")
    if (
        not isinstance(shape, list)
        or len(shape) > MAX_DIMS
        or not all(type(d) is int and d >= 0 for d in shape)
    ):
        raise ValueError(f"parameter {name!r}: its shape is not a list of non-negative integers")
    if type(identity) is not int:
        raise ValueError(f"parameter {name!r}: its identity is not an integer")
    if tp_dim is not None and (type(tp_dim) is not int or not 0 <= tp_dim < len(shape)):
        raise ValueError(f"parameter {name!r}: its tp dim is not one of its dims")
    if type(expert) is not bool or type(decayed) is not bool:
        raise ValueError(f"parameter {name!r}: its expert and decayed flags are not booleans")
    return ParameterShape(name, tuple(shape), identity, tp_dim, expert, decayed)


_TABLES: dict[str, ParameterTable] = {}


def _key(model: FamilyModel) -> str:
    return f"{model.spec.name}:{model.args!r}"


def table(model: FamilyModel) -> ParameterTable:
    """The table of `model`: made once per model in this process (read from the store when a
    plan `load`ed it first)."""
    key = _key(model)
    if key not in _TABLES:
        _TABLES[key] = _built(model)
    return _TABLES[key]


def stored(model: FamilyModel, store: BuildStore) -> bool:
    """Whether `load` reads the table of `model` from `store` (a plan of it was kept there)."""
    return store.has_kept(ParameterTable, {"model": _key(model)})


def load(model: FamilyModel, store: BuildStore | None) -> None:
    """Make `table(model)` read the table kept in `store` (kept there when it is not: the one
    this process has, or built)."""
    if store is not None:
        key = _key(model)
        _TABLES[key] = store.keep(ParameterTable, {"model": key}, lambda: table(model))


def _built(model: FamilyModel) -> ParameterTable:
    with torch.device("meta"):
        built = model.build()
    spec = model.spec
    plan = spec.tensor_plan(built, False) if spec.tensor_plan else {}
    # What expert parallelism splits: each MoE layer's `experts` (parallel/experts.py).
    experts = {id(p) for layer in spec.moe_layers(built) for p in layer.experts.parameters()}
    groups = param_groups(built, 1.0, roles_of(built, spec))
    decayed = {id(p) for group in groups if group["weight_decay"] for p in group["params"]}
    order: dict[int, int] = {}  # a tensor's identity: its first name's index
    return ParameterTable(
        tuple(
            ParameterShape(
                name,
                tuple(p.shape),
                order.setdefault(id(p), len(order)),
                _tp_dim(built, plan, name),
                id(p) in experts,
                id(p) in decayed,
            )
            for name, p in built.named_parameters(remove_duplicate=False)
        )
    )


def _tp_dim(model: nn.Module, plan: dict[str, Any], name: str) -> int | None:
    """The dim of parameter `name` that the tensor plan's style of its module shards, as torch's
    styles do (None: replicated)."""
    # Imported here: a plan that reads its tables from the store never imports torch's tensor
    # parallelism (about 0.5 s).
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    path, _, kind = name.rpartition(".")
    style = plan.get(path)
    embedding = isinstance(model.get_submodule(path), nn.Embedding)
    if isinstance(style, ColwiseParallel):
        return 1 if embedding else 0
    if isinstance(style, RowwiseParallel):
        return 0 if embedding else (1 if kind == "weight" else None)
    return None
