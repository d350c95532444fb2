"""LoRA (low-rank adapters, Hu et al. 2021) on any family's linear layers, as peft makes them:
`y = W x + b + (alpha / r) B A dropout(x)`, W and b frozen, A [r, in] kaiming-uniform (peft's
init), B [out, r] zeros, so training starts from the base model's exact outputs.

`apply_lora` turns the matching `nn.Linear`s of a model (or pipeline stage) still on the meta
device into `LoRALinear`s (the same module with two more parameters, `lora_A` and `lora_B`: the
base weight keeps its name, so pretrained weights, the tensor plan and the checkpoint names are
untouched) and freezes every other parameter. The layout applies it after the pipeline cut and
before tensor parallelism (parallel/parallelize.py); `place_lora_under_tp` then lays A and B out
beside a sharded base weight (column-wise: A replicated, B sharded on its rows like W; row-wise:
A sharded on its input columns like W, B replicated), so the adapter's math is the base's.
`init_lora` gives A and B their seeded values (a function of the seed and the parameter's name,
as every other init), so every layout starts from the same adapters.

Target modules are named as in peft: a name matches a linear whose module path is it or ends in
"." + it, in distrain's names ("attn.wq") or in the family's Hugging Face names ("q_proj",
"self_attn.q_proj"), through its `HfAdapter` tensors. `peft_tensors` gives the adapter's tensors
under peft's key names (`distrain export --format peft`); `merge_lora` folds them into the base
weights (`--format hf`).
"""

from __future__ import annotations

import math
import zlib
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from distrain.errors import ConfigError
from distrain.torch_compat import canonical_name

if TYPE_CHECKING:
    from distrain.config.schema import LoRAConfig
    from distrain.family.spec import ModelSpec

LORA_PARAMS = ("lora_A", "lora_B")


class LoRALinear(nn.Linear):
    """An `nn.Linear` with a low-rank adapter (made from one by `apply_lora`)."""

    lora_A: nn.Parameter
    lora_B: nn.Parameter
    scaling: float
    # A probability, not an nn.Dropout submodule: torch's row-wise tensor-parallel style
    # partitions every submodule of the linear as if it were one.
    lora_dropout: float

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        if self.lora_dropout:
            x = F.dropout(x, self.lora_dropout, self.training)
        low = F.linear(x, self.lora_A)
        return out + F.linear(low, self.lora_B) * self.scaling


def target_names(targets: str) -> list[str]:
    """lora.target_modules as a list of names."""
    return [t.strip() for t in targets.split(",") if t.strip()]


def hf_module_names(spec: ModelSpec, args: Any) -> dict[str, tuple[str, str]]:
    """distrain module path -> (its Hugging Face module path, the HfTensor kind) of every linear
    weight the family's adapter maps one to one (kind "same", or "transpose" for GPT-2's Conv1D):
    the modules an exported PEFT adapter can name."""
    if spec.hf is None:
        return {}
    names = {}
    for t in spec.hf.tensors(args):
        if (
            t.kind in ("same", "transpose")
            and len(t.names) == 1
            and t.names[0].endswith(".weight")
            and t.hf_name.endswith(".weight")
        ):
            names[t.names[0].removesuffix(".weight")] = (t.hf_name.removesuffix(".weight"), t.kind)
    return names


def _matches(path: str, target: str) -> bool:
    return path == target or path.endswith("." + target)


def lora_targets(
    model: nn.Module, spec: ModelSpec, args: Any, targets: str, *, strict: bool = True
) -> list[str]:
    """The module paths of `model`'s linears that lora.target_modules names (distrain's or the
    family's Hugging Face names); with `strict` (the whole model), a target that names none of
    its linears is refused (a pipeline stage may lack some). A target naming an MoE layer's
    router is refused: the layer reads its weight, never calls it, so an adapter there would not
    train (an MoE layer's experts are stacked weights, not linears: no target names them)."""
    hf = hf_module_names(spec, args)
    wanted = target_names(targets)
    routers = {id(getattr(layer, "router", None)) for layer in spec.moe_layers(model)}
    found: list[str] = []
    used: set[str] = set()
    for path, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        path = canonical_name(path)
        hf_path = hf.get(path, ("", ""))[0]
        hit = [t for t in wanted if _matches(path, t) or (hf_path and _matches(hf_path, t))]
        if hit and id(module) in routers:
            raise ConfigError(
                f"lora.target_modules: {', '.join(hit)} names the MoE router {path}, whose weight "
                "its layer reads without calling it (an adapter there would never train); "
                "leave it out"
            )
        if hit:
            found.append(path)
            used.update(hit)
    return found if used == set(wanted) or not strict else _refuse(wanted, used, model, hf)


def _refuse(wanted: list[str], used: set[str], model: nn.Module, hf: dict) -> list[str]:
    linears = sorted(
        {
            canonical_name(p).split(".")[-1]
            for p, m in model.named_modules()
            if isinstance(m, nn.Linear)
        }
        | {h.split(".")[-1] for h, _ in hf.values()}
    )
    missing = [t for t in wanted if t not in used]
    raise ConfigError(
        f"lora.target_modules: {', '.join(missing)} names none of the model's linear layers "
        f"(its linears: {', '.join(linears)})"
    )


def apply_lora(
    model: nn.Module, spec: ModelSpec, args: Any, cfg: LoRAConfig, *, strict: bool = True
) -> list[str]:
    """Freeze every parameter of `model` and give each targeted linear an adapter (A and B on the
    meta device when the model is); returns the adapted module paths. lora.rank 0: nothing (full
    fine-tuning). `strict`: as `lora_targets`'s."""
    if cfg.rank == 0:
        return []
    paths = lora_targets(model, spec, args, cfg.target_modules, strict=strict)
    for param in model.parameters():
        param.requires_grad_(False)
    modules = dict(model.named_modules())
    by_canonical = {canonical_name(p): m for p, m in modules.items()}
    for path in paths:
        linear = by_canonical[path]
        device, dtype = linear.weight.device, linear.weight.dtype
        linear.__class__ = LoRALinear
        linear.lora_A = nn.Parameter(
            torch.empty(cfg.rank, linear.in_features, device=device, dtype=dtype)
        )
        linear.lora_B = nn.Parameter(
            torch.empty(linear.out_features, cfg.rank, device=device, dtype=dtype)
        )
        linear.scaling = cfg.alpha / cfg.rank
        linear.lora_dropout = cfg.dropout
    return paths


def frozen_names(model: nn.Module) -> set[str]:
    """The canonical names of `model`'s frozen parameters."""
    return {canonical_name(n) for n, p in model.named_parameters() if not p.requires_grad}


def place_lora_under_tp(model: nn.Module, frozen: set[str]) -> None:
    """After tensor parallelism: the parameters frozen before it (`frozen_names`) frozen again
    (torch's sequence-parallel style makes new, trainable, norm weights), and A and B of each
    adapter whose base weight is sharded laid out so that B A x is computed as W x is
    (column-wise W [Shard(0)]: A replicated, B Shard(0); row-wise W [Shard(1)]: A Shard(1), B
    replicated; its partial sums are reduced with W's)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    for name, param in model.named_parameters():
        if canonical_name(name) in frozen:
            param.requires_grad_(False)
    for module in model.modules():
        if not isinstance(module, LoRALinear) or not isinstance(module.weight, DTensor):
            continue
        mesh, (placement,) = module.weight.device_mesh, module.weight.placements
        if placement == Shard(0):
            places = {"lora_A": Replicate(), "lora_B": Shard(0)}
        elif placement == Shard(1):
            places = {"lora_A": Shard(1), "lora_B": Replicate()}
        else:
            places = {"lora_A": Replicate(), "lora_B": Replicate()}
        for name, place in places.items():
            param = getattr(module, name)  # on the meta device: its values come at init
            full = torch.empty(param.shape, dtype=param.dtype, device=module.weight.device)
            value = distribute_tensor(full, mesh, [place], src_data_rank=None)
            setattr(module, name, nn.Parameter(value, requires_grad=True))


def lora_init_value(name: str, shape: torch.Size, seed: int) -> torch.Tensor:
    """The full fp32 initial value of adapter parameter `name` (canonical): B zeros; A
    kaiming-uniform with a = sqrt(5) as peft's (bound 1 / sqrt(in)), from the seed and name."""
    if name.endswith(".lora_B"):
        return torch.zeros(shape)
    gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
    bound = 1 / math.sqrt(shape[1])
    return torch.rand(shape, generator=gen) * (2 * bound) - bound


def is_lora_param(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in LORA_PARAMS


@torch.no_grad()
def init_lora(model: nn.Module, seed: int) -> None:
    """Fill every adapter parameter of a materialized `model` with its seeded value (a sharded
    one keeps its slice), after the family's init has filled the base weights."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    for name, param in model.named_parameters():
        name = canonical_name(name)
        if not is_lora_param(name):
            continue
        value = lora_init_value(name, param.shape, seed).to(param.device, param.dtype)
        if isinstance(param, DTensor):
            local = distribute_tensor(
                value, param.device_mesh, param.placements, src_data_rank=None
            ).to_local()
            param.to_local().copy_(local)
        else:
            param.copy_(value)


def base_source(source: Any) -> Any:
    """A pretrained-weights source that also answers for adapter parameters (zeros, replaced by
    `init_lora`), which the Hugging Face folder does not hold."""
    if source is None:
        return None

    def value(name: str, shape: torch.Size) -> torch.Tensor:
        return torch.zeros(shape) if is_lora_param(name) else source(name, shape)

    return value


@torch.no_grad()
def merge_lora(model: nn.Module) -> nn.Module:
    """Fold each adapter into its base weight (W + scaling B A) and turn the module back into a
    plain `nn.Linear`; returns `model` (plain tensors only, as export loads it)."""
    for module in model.modules():
        if isinstance(module, LoRALinear):
            module.weight += module.scaling * (module.lora_B @ module.lora_A)
            del module.lora_A, module.lora_B, module.lora_dropout
            module.__class__ = nn.Linear
    for param in model.parameters():
        param.requires_grad_(True)
    return model


def peft_tensors(
    model: nn.Module, spec: ModelSpec, args: Any
) -> tuple[dict[str, torch.Tensor], list[str], bool]:
    """(peft's adapter tensors by key, the Hugging Face names of the targeted modules, whether
    they are Conv1D ones (peft's fan_in_fan_out)) of a model holding `LoRALinear`s."""
    hf = hf_module_names(spec, args)
    tensors: dict[str, torch.Tensor] = {}
    targets: set[str] = set()
    kinds: set[str] = set()
    for path, module in model.named_modules():
        if not isinstance(module, LoRALinear):
            continue
        path = canonical_name(path)
        if path not in hf:
            raise ConfigError(
                f"export: the adapter of {path} has no Hugging Face module of its own to name "
                "(a fused or stacked weight there); export the merged model with --format hf"
            )
        hf_path, kind = hf[path]
        kinds.add(kind)
        targets.add(hf_path.rsplit(".", 1)[-1])
        key = f"base_model.model.{hf_path}"
        tensors[f"{key}.lora_A.weight"] = module.lora_A.detach().contiguous()
        tensors[f"{key}.lora_B.weight"] = module.lora_B.detach().contiguous()
    if len(kinds) > 1:
        raise ConfigError(
            "export: the adapter targets both Linear and Conv1D modules of the Hugging Face "
            "model, which one peft LoraConfig (fan_in_fan_out) cannot describe"
        )
    return tensors, sorted(targets), kinds == {"transpose"}
