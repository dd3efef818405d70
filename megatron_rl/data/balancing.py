"""Balanced partitioning of sequences: the Karmarkar-Karp heuristic and DP-rank balancing.

``karmarkar_karp_partition`` is the largest differencing method generalised to k partitions:
every item starts as a partial solution of k sets (with ``equal_size``, every k consecutive
items of the sorted list start as one partial solution, one item per set); the two partial
solutions with the largest spread (max set sum - min set sum) are merged by pairing the
heaviest set of one with the lightest of the other, until one solution is left. Merging never
makes the spread larger than the larger of the two merged spreads, so with ``equal_size`` the
final spread is at most the largest gap inside one group of k consecutive sorted items, which
is never worse than dealing the sorted items round-robin.

That bound is loose on long-tailed RL lengths when a mini-batch gives each rank few samples: a
group of k consecutive items that straddles the gap between the short bulk and the responses
cut at the maximum spreads by nearly the longest item. ``balance_across_dp`` therefore follows
Karmarkar-Karp with ``refine_by_swaps``: single-item swaps between the heaviest and the lightest
rank, which keep the counts, never widen the spread and, when they stop because no swap narrows
the pair (rather than at the cap of one swap per item), leave the spread at most the smallest
positive difference between an item of the heaviest and one of the lightest rank.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from collections.abc import Sequence

WORKLOAD_LINEAR_COEFFICIENT = 24576


def sequence_workload(length: int) -> int:
    """Relative compute cost of one sequence of ``length`` tokens: ``24576 * L + L**2``.

    verl's model: a per-token term for the dense projections and a quadratic attention term,
    so a few long sequences weigh more than many short ones of the same total length.
    """
    if length < 0:
        raise ValueError(f"sequence length must be >= 0, got {length}")
    return WORKLOAD_LINEAR_COEFFICIENT * length + length * length


# A partial solution: k sets as (sum, item indices), sorted by decreasing sum.
_Sets = list[tuple[float, list[int]]]


def _sorted_sets(sets: _Sets) -> _Sets:
    return sorted(sets, key=lambda entry: entry[0], reverse=True)


def karmarkar_karp_partition(
    workloads: Sequence[float],
    num_partitions: int,
    equal_size: bool = True,
) -> list[list[int]]:
    """Split item indices ``0..len(workloads)-1`` into ``num_partitions`` lists with balanced sums.

    Guarantees: every index appears exactly once; each list is sorted ascending; with
    ``equal_size`` every list has ``len(workloads) // num_partitions`` items (ValueError unless
    that division is exact); without it lists may differ in length and, when all workloads
    are positive, are empty only if there are fewer items than partitions. Lists are ordered
    by decreasing total workload. Deterministic: equal inputs give equal outputs.
    O(n log n + n k log k).
    """
    if num_partitions < 1:
        raise ValueError(f"num_partitions must be >= 1, got {num_partitions}")
    if any(workload < 0 for workload in workloads):
        raise ValueError(f"workloads must be >= 0, got min {min(workloads)}")
    num_items = len(workloads)
    if equal_size and num_items % num_partitions != 0:
        raise ValueError(
            f"equal_size partitioning needs the item count ({num_items}) to be divisible by "
            f"num_partitions ({num_partitions})"
        )
    order = sorted(range(num_items), key=lambda index: (workloads[index], index))
    group = num_partitions if equal_size else 1
    counter = itertools.count()
    heap: list[tuple[float, float, int, _Sets]] = []

    def push(sets: _Sets) -> None:
        heapq.heappush(heap, (-(sets[0][0] - sets[-1][0]), -sets[0][0], next(counter), sets))

    for start in range(0, num_items, group):
        members = order[start : start + group]
        sets = [(workloads[index], [index]) for index in members]
        push(_sorted_sets(sets + [(0, []) for _ in range(num_partitions - len(members))]))
    if not heap:
        return [[] for _ in range(num_partitions)]
    while len(heap) > 1:
        first = heapq.heappop(heap)[3]
        second = heapq.heappop(heap)[3]
        merged: _Sets = []
        for (heavy_sum, heavy_items), (light_sum, light_items) in zip(first, reversed(second), strict=True):
            heavy_items.extend(light_items)
            merged.append((heavy_sum + light_sum, heavy_items))
        push(_sorted_sets(merged))
    return [sorted(items) for _, items in heap[0][3]]


def refine_by_swaps(workloads: Sequence[float], parts: Sequence[Sequence[int]], max_swaps: int) -> list[list[int]]:
    """Narrow a partition of ``workloads`` by swapping single items between its heaviest and lightest part.

    Each swap exchanges item a of the heaviest part H (the first of equal sums) with item b of
    the lightest part L where ``0 < w_a - w_b < D = sum(H) - sum(L)``, the difference closest to
    D / 2. Both new sums then lie strictly between the old two, so: part sizes never change, the
    spread (max - min part sum) never grows, and the sum of squared part sums strictly falls (no
    partition repeats, so the loop would end without ``max_swaps``). It stops after
    ``max_swaps`` swaps or when no such pair exists; in the second case D is at most the smallest
    positive ``w_a - w_b`` over H x L. With equal part sizes and D > 0 such a positive difference
    always exists (were every item of H at most every item of L, sum(H) <= sum(L)), so the spread
    is then at most ``max(workloads) - min(workloads)``. Returns the parts in the given order,
    each sorted ascending. O(max_swaps * m log m) for parts of at most m items.
    """
    sorted_parts = [sorted(part) for part in parts]
    sums = [sum(workloads[index] for index in part) for part in sorted_parts]
    for _ in range(max_swaps):
        heavy = max(range(len(sorted_parts)), key=sums.__getitem__)
        light = min(range(len(sorted_parts)), key=sums.__getitem__)
        pair = _best_swap(workloads, sorted_parts[heavy], sorted_parts[light], sums[heavy] - sums[light])
        if pair is None:
            break
        a, b = pair
        sorted_parts[heavy] = sorted([index for index in sorted_parts[heavy] if index != a] + [b])
        sorted_parts[light] = sorted([index for index in sorted_parts[light] if index != b] + [a])
        difference = workloads[a] - workloads[b]
        sums[heavy] -= difference
        sums[light] += difference
    return sorted_parts


def _best_swap(
    workloads: Sequence[float], heavy: Sequence[int], light: Sequence[int], spread: float
) -> tuple[int, int] | None:
    """(a in ``heavy``, b in ``light``) with ``0 < w_a - w_b < spread`` closest to spread / 2, or None."""
    light_sorted = sorted(light, key=lambda index: (workloads[index], index))
    values = [workloads[index] for index in light_sorted]
    best: tuple[float, int, int] | None = None
    for a in heavy:
        position = bisect.bisect_left(values, workloads[a] - spread / 2)
        for candidate in (position - 1, position):
            if 0 <= candidate < len(values):
                difference = workloads[a] - values[candidate]
                if 0 < difference < spread and (best is None or abs(spread / 2 - difference) < best[0]):
                    best = (abs(spread / 2 - difference), a, light_sorted[candidate])
    return None if best is None else (best[1], best[2])


def balance_across_dp(lengths: Sequence[int], dp_size: int) -> list[list[int]]:
    """Assign sequences to ``dp_size`` data-parallel ranks with equal counts and balanced workload.

    ``lengths`` are token counts (prompt + response) of the B sequences of a step. Returns
    ``dp_size`` index lists of B / dp_size sequences each, each sorted ascending, balanced by
    ``sequence_workload``: Karmarkar-Karp (``karmarkar_karp_partition``), then at most B swaps
    of ``refine_by_swaps``, so the workload spread is never wider than Karmarkar-Karp's; rank r
    takes list r. Deterministic. Raises ValueError if B is not divisible by ``dp_size``.
    """
    if dp_size < 1:
        raise ValueError(f"dp_size must be >= 1, got {dp_size}")
    if len(lengths) % dp_size != 0:
        raise ValueError(
            f"cannot split a batch of {len(lengths)} sequences evenly across dp_size={dp_size} ranks; "
            "make the rollout batch (prompts x samples per prompt) a multiple of the data-parallel size"
        )
    workloads = [sequence_workload(length) for length in lengths]
    parts = karmarkar_karp_partition(workloads, dp_size, equal_size=True)
    return refine_by_swaps(workloads, parts, max_swaps=len(workloads))
