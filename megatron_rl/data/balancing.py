"""Balanced partitioning of sequences: the Karmarkar-Karp heuristic and DP-rank balancing.

``karmarkar_karp_partition`` is the largest differencing method generalised to k partitions:
every item starts as a partial solution of k sets (with ``equal_size``, every k consecutive
items of the sorted list start as one partial solution, one item per set); the two partial
solutions with the largest spread (max set sum - min set sum) are merged by pairing the
heaviest set of one with the lightest of the other, until one solution is left. Merging never
makes the spread larger than the larger of the two merged spreads, so with ``equal_size`` the
final spread is at most the largest gap inside one group of k consecutive sorted items, which
is never worse than dealing the sorted items round-robin.
"""

from __future__ import annotations

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


def balance_across_dp(lengths: Sequence[int], dp_size: int) -> list[list[int]]:
    """Assign sequences to ``dp_size`` data-parallel ranks with equal counts and balanced workload.

    ``lengths`` are token counts (prompt + response) of the B sequences of a step. Returns
    ``dp_size`` index lists of B / dp_size sequences each, balanced by ``sequence_workload``
    (see ``karmarkar_karp_partition``); rank r takes list r. Raises ValueError if B is not
    divisible by ``dp_size``.
    """
    if dp_size < 1:
        raise ValueError(f"dp_size must be >= 1, got {dp_size}")
    if len(lengths) % dp_size != 0:
        raise ValueError(
            f"cannot split a batch of {len(lengths)} sequences evenly across dp_size={dp_size} ranks; "
            "make the rollout batch (prompts x samples per prompt) a multiple of the data-parallel size"
        )
    return karmarkar_karp_partition([sequence_workload(length) for length in lengths], dp_size, equal_size=True)
