"""The optimizer's parameter groups: every parameter decayed but norms, biases and embedding
tables (`param_groups`), from the roles the model's family gives its parameters (`roles_of`).
Read by the optimizer builder (builder.py), a resumed run's state (train/state.py) and the
planner, which counts each group's values without building an optimizer."""

from __future__ import annotations

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from distrain.family.spec import ModelSpec, ParamRoles
from distrain.torch_compat import canonical_name


def roles_of(model: nn.Module, spec: ModelSpec) -> ParamRoles:
    """The family's roles of `model`'s parameters (a DDP-wrapped model's: its module's)."""
    return spec.param_roles(model.module if isinstance(model, DistributedDataParallel) else model)


def param_groups(
    model: nn.Module, weight_decay: float, roles: ParamRoles | None = None
) -> list[dict]:
    """Decay matrices only: norms, biases and embedding tables (`roles.undecayed`, a head tied
    to one too) stay undecayed (GPT-2 practice). Frozen parameters are left out, and so is a
    group they leave empty (a LoRA run's adapters are all matrices): torch's optimizer state
    dict cannot load a group without parameters."""
    roles = roles or ParamRoles()
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if param.ndim < 2 or canonical_name(name) in roles.undecayed:
            no_decay.append(param)
        else:
            decay.append(param)
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return [group for group in groups if group["params"]]
