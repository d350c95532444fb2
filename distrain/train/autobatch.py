"""Automatic micro-batch size (`training.micro_batch_size = "auto"`): before the first step, the
largest micro-batch that fits in memory, found by real trial steps on the built model.

Candidates are the sizes that divide a data-parallel rank's share of the global batch, so the
global batch (and the math) stays what the config says; accumulation makes up the rest. Each
trial runs one forward and backward of a micro-batch of that size (the first sequences of the
training set) and measures its peak memory:
- on CUDA, torch.cuda.max_memory_allocated since the trial began; a real
  torch.OutOfMemoryError fails the candidate;
- on CPU, where memory is not the device's limit, the live tensor bytes (plan/memory.py's
  `LiveBytes`, the planner's counter) on top of the parameters and the gradients.
The gradients are held throughout, as under accumulation: the unrecorded first trial makes
them, each trial's backward adds into them, and they are dropped after the search.
Both add the optimizer state the first step will allocate and the trial does not: Adam's two
moments, 2 x the bytes of the parameters this rank's optimizer updates. A candidate fails when
its peak exceeds `training.memory_budget_gb` (CUDA default: the device's memory) or it runs out
of memory (debug.oom_at_micro_batch injects that); every rank agrees on the verdict
(oom.any_rank_failed) before the next candidate, so all ranks choose the same size.

The search: one unrecorded trial at the smallest size (one-time allocations), then the two
smallest sizes, whose peaks give the activation slope (activations grow linearly with the
micro-batch: plan/memory.py's model). The largest size that slope says fits is tried next, then
a binary search between the largest size that fitted and the smallest that failed. (The
planner's own estimate runs on a fake process group, which a worker with a real one cannot
start; the two measured trials seed the search instead.)
The trials leave no trace: no optimizer step runs, gradients are dropped, the RNG states and the
MoE statistics are put back, so the loss curve equals a run with the chosen size set by hand.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from distrain.config.debug import DebugConfig
from distrain.config.schema import TrainingConfig
from distrain.data.dataset import TokenDataset
from distrain.data.loader import DistributedBatchLoader
from distrain.layout.facts import divisors
from distrain.parallel.device import DistContext
from distrain.parallel.model import ParallelModel
from distrain.plan.memory import LiveBytes, grad_bytes, local_bytes
from distrain.train import oom
from distrain.train.rng import rng_state, set_rng_state

GIB = 2**30


class MicroBatchDoesNotFit(oom.OutOfMemoryAtMicroBatchOne):
    """Even the smallest candidate exceeds the memory budget or runs out of memory."""


@dataclass(frozen=True)
class Trial:
    micro_batch_size: int
    peak_bytes: int
    """The largest peak measured over the ranks (a rank that ran out of memory measures none:
    0 when all did)."""
    out_of_memory: bool
    """Some rank ran out of memory (a real or an injected torch.OutOfMemoryError)."""
    fits: bool
    """Agreed by every rank: no rank ran out of memory or exceeded the budget."""


@dataclass(frozen=True)
class Choice:
    micro_batch_size: int
    budget_bytes: int
    trials: list[Trial]

    def metrics_row(self) -> dict:
        """The run's record of the choice (a metrics.jsonl row at step 0)."""
        return {
            "step": 0,
            "auto_micro_batch_size": self.micro_batch_size,
            "auto_memory_budget_bytes": self.budget_bytes,
            "auto_micro_batch_trials": [asdict(t) for t in self.trials],
        }


def candidates(global_batch_size: int, dp_size: int) -> list[int]:
    """Micro-batch sizes that split one data-parallel rank's share evenly, smallest first."""
    return divisors(global_batch_size // dp_size)


def budget_bytes(memory_budget_gb: float | None, device: torch.device) -> int:
    if memory_budget_gb is not None:
        return int(memory_budget_gb * GIB)
    # layout/rules.py refuses auto on CPU without a budget, so only CUDA gets here.
    return torch.cuda.get_device_properties(device).total_memory


def optimizer_state_bytes(optimizers: list[torch.optim.Optimizer]) -> int:
    """Adam's two moments for the parameters each optimizer updates on this rank (ZeRO-1: its
    partition, `optim`), which the first optimizer step allocates."""
    total = 0
    for optimizer in optimizers:
        inner = getattr(optimizer, "optim", optimizer)
        for group in inner.param_groups:
            total += 2 * sum(local_bytes(p) for p in group["params"])
    return total


def first_probe(sizes: list[int], peaks: tuple[int, int], budget: int) -> int:
    """Index of the largest candidate the two smallest trials' slope says fits (at least 2)."""
    slope = (peaks[1] - peaks[0]) / (sizes[1] - sizes[0])
    fitting = sizes[0] + (budget - peaks[0]) / slope if slope > 0 else sizes[-1]
    best = max((i for i, m in enumerate(sizes) if m <= fitting), default=0)
    return min(max(best, 2), len(sizes) - 1)


def search(sizes: list[int], run_trial: Callable[[int], Trial], budget: int) -> list[Trial]:
    """Trials in the order run; the choice is the largest size among those that fit."""
    trials = [run_trial(sizes[0])]
    if not trials[0].fits or len(sizes) == 1:
        return trials
    trials.append(run_trial(sizes[1]))
    if not trials[1].fits or len(sizes) == 2:
        return trials
    low, high = 1, len(sizes)  # sizes[low] fits; sizes[high] (if any) does not
    probe = first_probe(sizes, (trials[0].peak_bytes, trials[1].peak_bytes), budget)
    while high - low > 1:
        trial = run_trial(sizes[probe])
        trials.append(trial)
        low, high = (probe, high) if trial.fits else (low, probe)
        probe = (low + high) // 2
    return trials


class TrialStep:
    """One trial: forward and backward of `m` sequences, measured, verdict agreed by every rank.
    Runs the way oom.py's recovery runs a step, so a failure on one rank cannot strand the
    others in a collective: DDP layouts without gradient sync, then the agreement; FSDP2/tp
    layouts, whose forward runs collectives, agree before the forward (where the injected
    failure strikes) and synchronize their gradients within it."""

    def __init__(
        self,
        model: ParallelModel,
        optimizers: list[torch.optim.Optimizer],
        dataset: TokenDataset,
        *,
        budget: int,
        device: torch.device,
        oom_at_micro_batch: int,
        oom_here: bool,
    ):
        self.model, self.dataset, self.budget, self.device = model, dataset, budget, device
        self.optimizer_bytes = optimizer_state_bytes(optimizers)
        self.param_bytes = sum(local_bytes(p) for p in model.parameters())
        self.oom_at, self.oom_here = oom_at_micro_batch, oom_here
        self.agree_first = model.dims.dp_wrapper == "fsdp"

    def _inject(self, m: int) -> Callable[[int], None]:
        def before_micro_batch(index: int) -> None:
            if self.oom_here and self.oom_at and m >= self.oom_at:
                raise torch.OutOfMemoryError(
                    f"debug.oom_at_micro_batch: injected out-of-memory error at micro-batch {m}"
                )

        return before_micro_batch

    def _forward_backward(self, m: int) -> None:
        batch = self.dataset.get_batch([i % len(self.dataset) for i in range(m)])
        if self.agree_first:
            self.model.forward_backward(
                [batch],
                _unscaled,
                sync_each=True,
                before_micro_batch=oom.agreed(self._inject(m), self.device),
            )
        else:
            self.model.forward_backward(
                [batch], _unscaled, sync=False, before_micro_batch=self._inject(m)
            )

    def _measured(self, m: int) -> int:
        """This rank's peak bytes of one forward and backward of `m` sequences."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._forward_backward(m)
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device) + self.optimizer_bytes
        grads = grad_bytes(self.model.parameters())
        with LiveBytes(self.param_bytes + self.optimizer_bytes + grads) as live:
            self._forward_backward(m)
        return live.peak

    def __call__(self, m: int) -> Trial:
        peak, failed, abandoned = 0, False, False
        try:
            peak = self._measured(m)
        except oom.StepAbandoned:
            abandoned = True  # agreed already, by every rank
        except torch.OutOfMemoryError:
            failed = True
        oom.free_memory(self.device)
        out_of_memory = abandoned or oom.any_rank_failed(failed, self.device)
        over = oom.any_rank_failed(peak > self.budget, self.device)
        return Trial(
            m, _max_over_ranks(peak, self.device), out_of_memory, not (out_of_memory or over)
        )


def _unscaled(loss: torch.Tensor) -> torch.Tensor:
    # No loss scaling: the trial's gradients are dropped, and fp16's scaler keeps its state.
    return loss


def _max_over_ranks(value: int, device: torch.device) -> int:
    flag = torch.tensor([value], dtype=torch.int64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag.item())


def choose(
    model: ParallelModel,
    optimizers: list[torch.optim.Optimizer],
    dataset: TokenDataset,
    loader: DistributedBatchLoader,
    *,
    training: TrainingConfig,
    debug: DebugConfig,
    ctx: DistContext,
    logger: logging.Logger,
) -> Choice:
    """The largest candidate micro-batch whose trial fits, the same on every rank, set in the
    loader (the run's current micro-batch size); the model, optimizer, RNG and MoE statistics
    are as they were before. The model is built for micro-batch 1 until then."""
    t = training
    device, rank, dp_size = ctx.device, ctx.rank, loader.dp_size
    budget = budget_bytes(t.memory_budget_gb, device)
    run_trial = TrialStep(
        model,
        optimizers,
        dataset,
        budget=budget,
        device=device,
        oom_at_micro_batch=debug.oom_at_micro_batch,
        oom_here=debug.oom_rank in (-1, rank),
    )
    rng = rng_state()
    sizes = candidates(t.global_batch_size, dp_size)
    try:
        # Unrecorded: it makes the gradients the trials hold; the first forward after DDP's
        # settling iteration rebuilds its buckets (and CUDA sets up its libraries), once; the
        # measured trials then see what steps see.
        run_trial(sizes[0])
        trials = search(sizes, run_trial, budget)
    finally:
        model.zero_grad()
        set_rng_state(rng)
        if model.moe_stats is not None:
            model.moe_stats.discard_step()
    fitting = [trial.micro_batch_size for trial in trials if trial.fits]
    if not fitting:
        raise MicroBatchDoesNotFit(
            f"training.micro_batch_size = 'auto': even micro-batch {trials[0].micro_batch_size} "
            f"needs {trials[0].peak_bytes / GIB:.3f} GiB (budget {budget / GIB:.3f} GiB, "
            f"out of memory: {trials[0].out_of_memory}); raise training.memory_budget_gb, use "
            "activation checkpointing, ZeRO (parallel.zero_stage), tp, or a shorter seq_len"
        )
    choice = Choice(max(fitting), budget, trials)
    loader.set_micro_batch_size(choice.micro_batch_size)
    logger.info(
        "training.micro_batch_size auto: %d (budget %.3f GiB; trials %s)",
        choice.micro_batch_size,
        budget / GIB,
        ", ".join(
            f"{x.micro_batch_size}: {x.peak_bytes / GIB:.4f} GiB "
            f"{'fits' if x.fits else 'out of memory' if x.out_of_memory else 'over budget'}"
            for x in trials
        ),
    )
    return choice
