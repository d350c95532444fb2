"""The `[debug]` section of the config: fault injection for tests and chaos runs, and the
consistency checks that help find a fault (schema only; schema.py holds the rest of the schema,
the production timeouts and thresholds among it: `[comm]` and `[watchdog]`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from distrain.config.ranges import ANY_RANK, AT_LEAST_0, doc


@dataclass(kw_only=True, slots=True)
class DebugConfig:
    fail_at_step: int = doc(
        0,
        "Fault injection: crash when this step begins (0 = never); for tests and chaos runs.",
        AT_LEAST_0,
    )
    fail_rank: int = doc(-1, "Rank that crashes at debug.fail_at_step (-1 = every rank).", ANY_RANK)
    fail_mode: Literal["exception", "kill"] = doc(
        "exception", "How the injected crash happens: raise an exception, or SIGKILL the process."
    )
    fail_attempt: int = doc(
        0,
        "Crash (and hang, and damage debug.corrupt_checkpoint_step) only in this attempt of an "
        "elastic run (torchrun's restart count), so the restarted workers run on.",
        AT_LEAST_0,
    )
    corrupt_checkpoint_step: int = doc(
        0,
        "Fault injection: after the checkpoint of this step is committed, flip one byte of one "
        "of its shard files, so the next resume must detect it and fall back (0 = never); in "
        "attempt debug.fail_attempt only, so the restart's own save of this step stays whole.",
        AT_LEAST_0,
    )
    oom_at_step: int = doc(
        0,
        "Fault injection: raise an out-of-memory error inside this step (0 = never).",
        AT_LEAST_0,
    )
    oom_rank: int = doc(
        -1,
        "Rank that runs out of memory at debug.oom_at_step or debug.oom_at_micro_batch (-1 = "
        "every rank).",
        ANY_RANK,
    )
    oom_at_micro_batch: int = doc(
        0,
        "Fault injection: with training.micro_batch_size = auto, the trial steps of this "
        "micro-batch size and larger raise an out-of-memory error (0 = never).",
        AT_LEAST_0,
    )
    preempt_delay_s: float = doc(
        0.0,
        "Fault injection: after a stop signal, wait this long between writing the preempt "
        "checkpoint and committing it, so a test can send a second signal during the save.",
        AT_LEAST_0,
    )
    hold_checkpoint_step: int = doc(
        0,
        "Fault injection: the checkpoint of this step is written but held uncommitted for an "
        "hour (with checkpoint.async_mode = 'thread' training goes on meanwhile), in attempt "
        "debug.fail_attempt only, so a test can kill a rank during a background save "
        "(0 = never).",
        AT_LEAST_0,
    )
    check_replicas: bool = doc(
        False,
        "After every logged step, check that parameters agree across data-parallel replicas "
        "(and across tp ranks for tp-replicated ones, across stages for a tied embedding); a "
        "mismatch names the tensor and the ranks.",
    )
    hang_at_step: int = doc(
        0,
        "Fault injection: sleep forever inside the backward pass of this step (0 = never), in "
        "attempt debug.fail_attempt only.",
        AT_LEAST_0,
    )
    hang_rank: int = doc(-1, "Rank that hangs at debug.hang_at_step (-1 = every rank).", ANY_RANK)
    nan_at_step: int = doc(
        0,
        "Fault injection: make one gradient NaN in this step, after backward (0 = never).",
        AT_LEAST_0,
    )
    nan_rank: int = doc(-1, "Rank whose gradient turns NaN at debug.nan_at_step.", ANY_RANK)
    slow_rank: int = doc(
        -1, "Fault injection: this rank sleeps debug.slow_ms in every step (-1 = none).", ANY_RANK
    )
    slow_ms: float = doc(0.0, "Milliseconds debug.slow_rank sleeps per step.", AT_LEAST_0)
