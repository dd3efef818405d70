"""Token-budget micro-batching: split one rank's sequences into balanced micro-batches.

Every data-parallel rank must run the same number of micro-batches per step (pipeline
schedules and collectives assume it). The protocol, as in verl's dynamic batch size:

1. each rank calls ``token_budget_micro_batches(lengths, budget)`` and takes ``len()`` of it;
2. the ranks all-reduce that count with MAX;
3. each rank calls again with ``min_num_micro_batches`` = the maximum.

The search for the count: starting from ``max(min_num_micro_batches, ceil(total / budget))``,
try Karmarkar-Karp into k token-balanced micro-batches and take the first k whose
micro-batches all fit the budget. First-fit decreasing bounds the search: at its bin count
(within 11/9 of the optimum) a fitting split is built from its bins if Karmarkar-Karp's does
not fit, so the count never exceeds ``max(min_num_micro_batches, first-fit-decreasing count)``.
"""

from __future__ import annotations

from collections.abc import Sequence

from megatron_rl.data.balancing import karmarkar_karp_partition


def _first_fit_decreasing(lengths: Sequence[int], budget: int) -> list[list[int]]:
    bins: list[list[int]] = []
    loads: list[int] = []
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        target = next((b for b, load in enumerate(loads) if load + lengths[index] <= budget), len(bins))
        if target == len(bins):
            bins.append([])
            loads.append(0)
        bins[target].append(index)
        loads[target] += lengths[index]
    return bins


def _split_to_count(bins: list[list[int]], lengths: Sequence[int], count: int) -> list[list[int]]:
    """Split the most populated bins in two (balanced) until there are ``count``; each part still fits."""
    bins = [list(b) for b in bins]
    while len(bins) < count:
        largest = max(range(len(bins)), key=lambda b: (len(bins[b]), sum(lengths[i] for i in bins[b])))
        members = bins.pop(largest)
        halves = karmarkar_karp_partition([lengths[i] for i in members], 2, equal_size=False)
        bins.extend([members[position] for position in half] for half in halves)
    return bins


def _fits(parts: list[list[int]], lengths: Sequence[int], budget: int) -> bool:
    return all(parts) and all(sum(lengths[i] for i in part) <= budget for part in parts)


def token_budget_micro_batches(
    lengths: Sequence[int],
    max_tokens_per_micro_batch: int,
    min_num_micro_batches: int = 1,
) -> list[list[int]]:
    """Group sequence indices into micro-batches of at most ``max_tokens_per_micro_batch`` tokens.

    ``lengths`` are token counts (prompt + response) per sequence, each >= 1. Guarantees:
    every index in exactly one micro-batch; every micro-batch non-empty and within the budget;
    at least ``min_num_micro_batches`` micro-batches (see the module docstring for the count);
    token totals balanced across micro-batches. Micro-batches are ordered by decreasing token
    total, indices ascending within each. Raises ValueError if a sequence alone exceeds the
    budget, or if ``min_num_micro_batches`` exceeds the number of sequences (a micro-batch
    would be empty).
    """
    budget = max_tokens_per_micro_batch
    if budget < 1:
        raise ValueError(f"max_tokens_per_micro_batch must be >= 1, got {budget}")
    if min_num_micro_batches < 1:
        raise ValueError(f"min_num_micro_batches must be >= 1, got {min_num_micro_batches}")
    for index, length in enumerate(lengths):
        if length < 1:
            raise ValueError(f"sequence {index} has length {length}; sequence lengths must be >= 1")
        if length > budget:
            raise ValueError(
                f"sequence {index} has {length} tokens, more than max_tokens_per_micro_batch={budget}; "
                "raise the budget to at least the longest prompt + response length"
            )
    if min_num_micro_batches > len(lengths):
        raise ValueError(
            f"min_num_micro_batches={min_num_micro_batches} exceeds the {len(lengths)} sequences on this rank; "
            "every micro-batch needs a sequence (balance ranks to equal counts first)"
        )
    fallback = _first_fit_decreasing(lengths, budget)
    count = max(min_num_micro_batches, -(-sum(lengths) // budget))
    while True:
        parts = karmarkar_karp_partition(lengths, count, equal_size=False)
        if _fits(parts, lengths, budget):
            break
        if count >= len(fallback):
            parts = _split_to_count(fallback, lengths, count)
            break
        count += 1
    return sorted((sorted(part) for part in parts), key=lambda part: (-sum(lengths[i] for i in part), part[0]))
