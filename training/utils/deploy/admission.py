"""How the engine turns queued sequences into prefill forwards: which join the batch at once, and how prompts of
mixed lengths split into forwards that waste little padding."""

from __future__ import annotations

import math
from collections import deque

from training.utils.deploy.sequences import SequenceGroup, SequenceState

PREFILL_TOKEN_BUDGET = 32768
"""Most padded prompt tokens (rows x longest prompt) prefilled in one forward, bounding the memory of a
prefill and the time decode rows wait for it; a single prompt always fits."""

PREFILL_SPLIT_COST_TOKENS = 32
"""What one more prefill forward costs on CPU, in extra prompt tokens: its fixed cost, mostly reading the
weights, weighed against the padding a split saves (`split_by_length`; the Sampler throughput section of
benchmarks/RESULTS.md, from benchmarks/sampler_throughput.py). Elsewhere a forward's fixed cost (kernel
launches on a GPU) dwarfs padding, and admitted prompts are prefilled in one forward."""


def admit(pending: deque[SequenceState], free: int) -> list[SequenceState]:
    """Take the sequences to prefill now from the front of `pending`: at most `free`, dropping those of
    cancelled requests, and only as many distinct requests as fit `PREFILL_TOKEN_BUDGET` padded together
    (the first always does). The caller holds the lock guarding `pending`."""
    admitted: list[SequenceState] = []
    groups: list[SequenceGroup] = []
    longest = 0
    while pending and len(admitted) < free:
        seq = pending[0]
        if seq.group.cancelled:
            pending.popleft()
            continue
        if seq.group not in groups:
            cost = (len(groups) + 1) * max(longest, len(seq.group.prompt_ids))
            if groups and cost > PREFILL_TOKEN_BUDGET:
                break
            groups.append(seq.group)
            longest = max(longest, len(seq.group.prompt_ids))
        admitted.append(pending.popleft())
    return admitted


def split_by_length(lengths: list[int], forward_cost: int | None) -> list[list[int]]:
    """Partition prompts (by index) into prefill forwards, longest first, minimizing padded tokens + forwards.

    A forward is left-padded to its longest prompt, so it costs (prompts x longest) tokens,
    plus `forward_cost` tokens for the forward itself; None = always one forward. Sorted by
    length, the best partition is into contiguous runs, found by dynamic programming over the
    run boundaries (O(n^2) for n prompts, at most `max_batch_requests`).
    """
    if forward_cost is None or len(lengths) < 2:
        return [list(range(len(lengths)))]
    order = sorted(range(len(lengths)), key=lambda i: lengths[i], reverse=True)
    n = len(order)
    cost = [0] + [math.inf] * n  # cost[j]: cheapest prefill of the j longest prompts
    start = [0] * (n + 1)  # start[j]: where the last forward of that prefill starts
    for j in range(1, n + 1):
        for i in range(j):
            c = cost[i] + forward_cost + (j - i) * lengths[order[i]]
            if c < cost[j]:
                cost[j], start[j] = c, i
    chunks, j = [], n
    while j > 0:
        chunks.append(order[start[j] : j])
        j = start[j]
    return chunks[::-1]
