"""Which layers each pipeline stage holds (`stage_layer_ranges`) and which stages each pp rank
holds (`stage_ids_for_rank`): arithmetic only, so that the planner prices pipelines without
importing torch's pipelining (and with it dynamo). Placement is loop-style for every schedule:
rank r holds stages r, r + pp, r + 2 pp, ... (pipeline.py says why)."""

from __future__ import annotations


def stage_layer_ranges(n_layers: int, num_stages: int) -> list[range]:
    """Contiguous, balanced layer ranges, one per stage.

    Every stage gets n_layers // num_stages layers. The remainder goes one layer each to the
    middle stages (1, 2, ...) first, because the first stage also runs the embedding and the last
    the output projection and loss; only if more remain than there are middle stages does the
    first stage take one (its embedding lookup is cheaper than the last stage's vocab matmul).
    The last stage never gets an extra layer when num_stages > 1.
    """
    if num_stages < 1 or num_stages > n_layers:
        # layout/rules.py refuses such configs; this guards direct callers.
        raise ValueError(f"{n_layers} layers cannot fill {num_stages} stages")
    counts = [n_layers // num_stages] * num_stages
    extra_order = list(range(1, num_stages - 1)) + [0]
    for stage in extra_order[: n_layers % num_stages]:
        counts[stage] += 1
    starts = [sum(counts[:i]) for i in range(num_stages)]
    return [range(start, start + count) for start, count in zip(starts, counts, strict=True)]


def stage_ids_for_rank(
    pp_rank: int, pp_size: int, stages_per_rank: int, schedule: str
) -> list[int]:
    """The stages pp rank `pp_rank` holds, in increasing order (loop placement, see module doc).
    Which schedules take how many stages per rank is one of layout/rules.py's rules."""
    return [pp_rank + i * pp_size for i in range(stages_per_rank)]
