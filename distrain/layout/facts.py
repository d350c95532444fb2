"""What the layout rules (rules.py) look at: `Facts`, a config with its model shape, world
size and resolved degrees, and the quantities derived from them that the rules and their
messages read."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from distrain.config.batch import BatchSizes
from distrain.config.schema import CommConfig, Config, ParallelConfig, TrainingConfig
from distrain.data.tokenizer import load_tokenizer
from distrain.errors import MissingInput
from distrain.family.spec import ModelShape, ModelSpec
from distrain.ft.network import secret_missing, secret_needed
from distrain.optim.capability import OptimizerCapability, optimizer_capability
from distrain.parallel.device import pick_device
from distrain.parallel.mesh import ParallelDims, data_parallel_size


def divisors(n: int) -> list[int]:
    """The positive divisors of `n`, smallest first (none for n <= 0)."""
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class Facts:
    """What the rules look at; the short names keep the message templates readable."""

    cfg: Config
    spec: ModelSpec
    """The model family's."""
    model: ModelShape
    world_size: int | None = None
    dims: ParallelDims | None = None
    absent: list[str] | None = None
    """Where to note a file that is not there instead of refusing (`train --check`)."""

    @property
    def p(self) -> ParallelConfig:
        return self.cfg.parallel

    @property
    def t(self) -> TrainingConfig:
        return self.cfg.training

    @property
    def c(self) -> CommConfig:
        return self.cfg.comm

    @property
    def tp_pp(self) -> int:
        return self.p.tp * self.p.pp

    @property
    def dp(self) -> int:
        """Data-parallel size (before the degrees are resolved into `dims`)."""
        assert self.world_size is not None
        return data_parallel_size(self.p, self.world_size)

    @property
    def dp_arithmetic(self) -> str:
        """How the data-parallel size follows from the world size, for messages."""
        others = [
            f"{axis} {n}" for axis, n in (("cp", self.p.cp), ("tp", self.p.tp), ("pp", self.p.pp))
        ]
        return f"world {self.world_size} / ({' x '.join(others)})"

    @property
    def cp_chunks(self) -> int:
        """Chunks context parallelism cuts a sequence into: two per cp rank."""
        return 2 * self.p.cp

    @property
    def cp_positions(self) -> int:
        """Positions of a sequence one cp rank holds."""
        return self.t.seq_len // self.p.cp

    @property
    def cp_tp(self) -> int:
        return self.p.cp * self.p.tp

    @property
    def cp_tp_pp(self) -> int:
        return self.tp_pp * self.p.cp

    @property
    def cp_conflict(self) -> str:
        """The first setting context parallelism does not compose with yet, and what is missing
        for it ("" when none)."""
        conflicts = {
            f"parallel.zero_stage = 1 with parallel.tp = {self.p.tp} (FSDP2 shards over cp and "
            "ZeRO-1 over dp, as under pp, but no parity run covers tp yet)": (
                self.p.zero_stage == 1 and self.p.tp > 1
            ),
            f"an MoE model (model.moe.num_experts = {self.num_experts}; its balancing losses and "
            "load statistics are not reduced over the cp ranks)": self.num_experts > 0,
        }
        return next((name for name, on in conflicts.items() if on), "")

    @property
    def optimizer(self) -> OptimizerCapability:
        """What the optimizer takes over from the data-parallel layer under this layout."""
        return optimizer_capability(
            self.cfg.optim, zero_stage=self.p.zero_stage, tp=self.p.tp, pp=self.p.pp
        )

    @property
    def momentum_exchange_conflict(self) -> str:
        """The first setting that an optimizer exchanging its momentum itself (1-bit Adam) does
        not compose with, and why ("" when none, or when the optimizer does not)."""
        if not self.optimizer.exchanges_momentum:
            return ""
        z = self.p.zero_stage
        conflicts = {
            "parallel.zero_stage = 3 (FSDP2 reduce-scatters fp32 gradients itself inside "
            "backward)": z == 3,
            f"parallel.zero_stage = {z} under tp {self.p.tp} / pp {self.p.pp} (its owner chunks "
            "would mix tp-replicated and sharded values; not supported yet)": (
                self.optimizer.shards_state and self.tp_pp > 1
            ),
            f"comm.gradient_compression = {self.c.gradient_compression!r} (a DDP hook on "
            "gradients that 1-bit Adam does not send)": self.c.gradient_compression != "none",
            "training.oom_recovery (its retry all-reduces the gradients, which 1-bit Adam sends "
            "compressed past warm-up or averages itself; not supported yet)": self.t.oom_recovery,
        }
        return next((name for name, on in conflicts.items() if on), "")

    @property
    def lora_unproven(self) -> tuple[str, str]:
        """(the first setting no LoRA test runs with, how to drop it); ("", "") when none, or
        when LoRA is off."""
        if self.cfg.lora.rank == 0:
            return "", ""
        unproven = {
            (f"parallel.cp = {self.p.cp} (context parallelism)", "set parallel.cp = 1"): (
                self.p.cp > 1
            ),
            (f"parallel.ep = {self.p.ep} (expert parallelism)", "set parallel.ep = 1"): (
                self.p.ep > 1
            ),
            (
                f"diloco.inner_steps = {self.inner_steps} (DiLoCo)",
                "set diloco.inner_steps = 0",
            ): self.inner_steps > 0,
            ("optim.name = 'onebit_adam' (1-bit Adam)", "set optim.name = 'adamw'"): (
                self.cfg.optim.name == "onebit_adam"
            ),
        }
        return next((setting for setting, on in unproven.items() if on), ("", ""))

    @property
    def inner_steps(self) -> int:
        """diloco.inner_steps: DiLoCo's H (0 = off)."""
        return self.cfg.diloco.inner_steps

    @property
    def diloco_conflict(self) -> str:
        """The first setting DiLoCo does not compose with, and why ("" when none, or when
        DiLoCo is off)."""
        if not self.inner_steps:
            return ""
        conflicts = {
            f"optim.name = {self.cfg.optim.name!r} (it averages its momentum over every "
            "data-parallel rank, across sites)": self.optimizer.exchanges_momentum,
            f"parallel.ep = {self.p.ep} (expert weights are sharded over a mesh that spans the "
            "sites)": self.p.ep > 1,
            f"an MoE model (model.moe.num_experts = {self.num_experts}; its load statistics are "
            "reduced over every site; not supported yet)": self.num_experts > 0,
            "training.oom_recovery (not supported yet)": self.t.oom_recovery,
            "training.precision = 'fp16' (not supported yet)": self.t.precision == "fp16",
            "debug.check_replicas (the sites' weights differ between outer steps)": (
                self.cfg.debug.check_replicas
            ),
        }
        return next((name for name, on in conflicts.items() if on), "")

    @property
    def groups(self) -> int:
        """fault_tolerance.replica_groups (0 = off)."""
        return self.cfg.fault_tolerance.replica_groups

    @property
    def fault_tolerance_conflict(self) -> str:
        """The first setting replica groups that survive each other do not compose with (""
        when none, or when they are off)."""
        if not self.groups:
            return ""
        conflicts = {
            f"parallel.dp_replicate = {self.p.dp_replicate} (the replica groups are the "
            "replicated dimension: each is its own torchrun)": self.p.dp_replicate > 1,
            f"parallel.cp = {self.p.cp} (not supported yet: no test runs context parallelism "
            "inside a replica group)": self.p.cp > 1,
            f"parallel.ep = {self.p.ep} (not supported yet: the MoE load statistics and expert "
            "biases are reduced inside a group only)": self.p.ep > 1,
            f"an MoE model (model.moe.num_experts = {self.num_experts}; its load statistics "
            "and expert-bias update are reduced inside a group only, so the groups' routers "
            "would drift apart; not supported yet)": self.num_experts > 0,
            "diloco.inner_steps (DiLoCo's sites are torchrun's dp_replicate groups, which "
            "replica groups replace; not supported yet)": self.inner_steps > 0,
            "training.precision = 'fp16' (its loss scale is agreed inside a group only)": (
                self.t.precision == "fp16"
            ),
            "training.oom_recovery (a group's micro-batch split would differ from its peers')": (
                self.t.oom_recovery
            ),
            "training.micro_batch_size = 'auto' (every group must split alike)": (
                self.auto_micro_batch
            ),
            f"comm.gradient_compression = {self.c.gradient_compression!r} (not supported yet)": (
                self.c.gradient_compression != "none"
            ),
        }
        return next((name for name, on in conflicts.items() if on), "")

    @property
    def lighthouse_missing(self) -> bool:
        """Replica groups are on and neither fault_tolerance.lighthouse nor TORCHFT_LIGHTHOUSE
        says where the lighthouse is."""
        ft = self.cfg.fault_tolerance
        return bool(self.groups) and not (ft.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE"))

    @property
    def lighthouse(self) -> str:
        """Where the replica groups' lighthouse is ("" when it is not said)."""
        ft = self.cfg.fault_tolerance
        return ft.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE", "")

    @property
    def secret_missing(self) -> bool:
        """Replica groups whose lighthouse or fault_tolerance.bind is not on a loopback address
        (they may span hosts, their servers answer the network) and no fault_tolerance.
        secret_file to authenticate them with."""
        ft = self.cfg.fault_tolerance
        return (
            bool(self.groups)
            and bool(self.lighthouse)
            and not ft.secret_file
            and secret_needed(self.lighthouse, ft.bind)
        )

    @property
    def secret_missing_message(self) -> str:
        return secret_missing(self.lighthouse, self.cfg.fault_tolerance.bind)

    @property
    def survivor_counts_not_splitting_batch(self) -> str:
        """The numbers of live replica groups whose ranks cannot split the global batch into
        whole micro-batches ("" when every count from 1 to fault_tolerance.replica_groups
        can)."""
        assert self.dims is not None
        if not self.groups or self.auto_micro_batch:
            return ""
        per_group = self.survivor_split_unit * self.dims.dp_size
        bad = [n for n in range(1, self.groups + 1) if self.t.global_batch_size % (per_group * n)]
        return ", ".join(str(n) for n in bad)

    @property
    def survivor_split_unit(self) -> int:
        """The sequences a data-parallel rank's share of the global batch must be a multiple
        of, whatever the number of live replica groups: the micro-batch, and under pp also the
        pipeline microbatch, whose size stays when the survivors' share grows
        (`ParallelModel.fit_pipeline_batch`)."""
        assert self.dims is not None
        unit = self.t.micro_batch_size
        if self.p.pp > 1 and self.p.pp_microbatches > 0:
            unit = math.lcm(unit, max(1, self.local_batch // self.p.pp_microbatches))
        return unit

    @property
    def survivor_pipeline_refused(self) -> str:
        """Under pp with replica groups, the first number of live groups whose pipeline
        microbatch count the schedule refuses, as "N group(s): M microbatches" ("" when every
        count from 1 to fault_tolerance.replica_groups suits it). The survivors' schedule keeps
        its microbatch size and runs more of them (`ParallelModel.fit_pipeline_batch`); torch's
        own constraints: 1F1B at least one microbatch per stage, the interleaved schedules a
        multiple of their rounds."""
        assert self.dims is not None
        if not self.groups or self.p.pp == 1 or self.auto_micro_batch:
            return ""
        local = self.local_batch
        first = self.p.pp_microbatches if self.p.pp_microbatches > 0 else self.batch.accumulation
        rows = max(1, local // first)
        for n in range(1, self.groups + 1):
            if self.t.global_batch_size % (rows * self.dims.dp_size * n):
                continue  # batch_splits_over_survivors refuses it
            count = self.t.global_batch_size // (rows * self.dims.dp_size * n)
            if self.p.pp_schedule == "gpipe":
                refused = False
            elif self.p.pp_schedule == "1f1b":
                refused = count < self.num_stages
            else:
                refused = count % max(1, count // self.p.pp) != 0
            if refused:
                return f"{n} live group(s): {count} microbatch(es) of {rows}"
        return ""

    @property
    def survivors_batch_unit(self) -> int:
        """The smallest global batch every live-group count can split: `survivor_split_unit` x
        the group's data-parallel size x lcm(1 .. replica_groups)."""
        assert self.dims is not None
        unit = self.survivor_split_unit * self.dims.dp_size
        return unit * math.lcm(*range(1, self.groups + 1))

    @property
    def dp_divisors(self) -> str:
        return ", ".join(str(d) for d in divisors(self.dp))

    @property
    def num_stages(self) -> int:
        return self.p.pp * self.p.pp_stages_per_rank

    @property
    def batch(self) -> BatchSizes:
        """The run's batch arithmetic on the resolved degrees."""
        assert self.dims is not None
        micro = 1 if self.auto_micro_batch else self.t.micro_batch_size
        return BatchSizes(global_batch=self.t.global_batch_size, dp=self.dims.dp_size, micro=micro)

    @property
    def local_batch(self) -> int:
        """Sequences per step on one data-parallel rank."""
        return self.batch.local

    @property
    def tp_uneven(self) -> str:
        """The first model size that parallel.tp does not divide ("" when all split evenly)."""
        return next((name for name, size in self.model.tp_split if size % self.p.tp), "")

    @property
    def model_size(self) -> int:
        return dict(self.model.tp_split)[self.tp_uneven]

    @property
    def tp_choices(self) -> str:
        common = math.gcd(*(size for _, size in self.model.tp_split))
        return ", ".join(str(d) for d in range(1, common + 1) if common % d == 0)

    @property
    def replicate_world(self) -> int:
        """The world size that parallel.dp_replicate asks for (zero_stage 0/1)."""
        return self.p.dp_replicate * self.cp_tp_pp

    @property
    def auto_micro_batch(self) -> bool:
        """training.micro_batch_size = 'auto': the trainer picks it (train/autobatch.py)."""
        return self.t.micro_batch_size == "auto"

    @property
    def num_experts(self) -> int:
        return self.model.num_experts

    @property
    def ep_choices(self) -> str:
        e = self.num_experts
        return ", ".join(str(d) for d in range(1, e + 1) if e % d == 0)

    @property
    def ep_conflict(self) -> str:
        """The first setting that is a DDP communication hook, which expert parallelism (on
        FSDP2) has no place for ("" when there is none)."""
        conflicts = {
            f"comm.gradient_compression = {self.c.gradient_compression!r}": (
                self.c.gradient_compression != "none"
            ),
            "comm.hierarchical": self.c.hierarchical,
            f"optim.name = {self.cfg.optim.name!r}": self.optimizer.exchanges_momentum,
        }
        return next((name for name, found in conflicts.items() if found), "")

    @property
    def tokenizer_vocab(self) -> int:
        """data.tokenizer's vocabulary; 0 (no rule refuses on it) when its file is not there
        and the facts note absent files."""
        try:
            return load_tokenizer(self.cfg.data.tokenizer).vocab_size
        except MissingInput as e:
            if self.absent is None:
                raise
            if str(e) not in self.absent:
                self.absent.append(str(e))
            return 0

    @property
    def padded_vocab(self) -> int:
        """The tokenizer's vocabulary rounded up to a multiple of 64 (even tp splits, aligned
        matmuls)."""
        return -(-self.tokenizer_vocab // 64) * 64

    @property
    def sharded(self) -> bool:
        """Parameters or gradients sharded, or split by tp/pp: DDP's hooks do not apply."""
        return self.p.zero_stage >= 2 or self.p.tp > 1 or self.p.pp > 1

    @property
    def ddp_detail_on_gloo(self) -> bool:
        """TORCH_DISTRIBUTED_DEBUG=DETAIL is set and the model is wrapped in DDP on gloo."""
        assert self.dims is not None
        detail = os.environ.get("TORCH_DISTRIBUTED_DEBUG", "").upper() == "DETAIL"
        backend = pick_device(self.cfg.run.device, 0)[1]
        return detail and backend == "gloo" and self.dims.dp_wrapper == "ddp"
