"""Karmarkar-Karp partitioning, DP balancing and token-budget micro-batching."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_rl.data import (
    balance_across_dp,
    karmarkar_karp_partition,
    sequence_workload,
    token_budget_micro_batches,
)
from megatron_rl.data.balancing import refine_by_swaps


def sums(parts: Sequence[Sequence[int]], values: Sequence[int]) -> list[int]:
    return [sum(values[i] for i in part) for part in parts]


def spread(parts: Sequence[Sequence[int]], values: Sequence[int]) -> int:
    totals = sums(parts, values)
    return max(totals) - min(totals)


def assert_exact_cover(parts: Sequence[Sequence[int]], num_items: int) -> None:
    flat = [index for part in parts for index in part]
    assert sorted(flat) == list(range(num_items))


def first_fit_decreasing_count(lengths: Sequence[int], budget: int) -> int:
    loads: list[int] = []
    for length in sorted(lengths, reverse=True):
        slot = next((b for b, load in enumerate(loads) if load + length <= budget), None)
        if slot is None:
            loads.append(length)
        else:
            loads[slot] += length
    return len(loads)


def test_sequence_workload_is_verls_model() -> None:
    assert sequence_workload(0) == 0
    assert sequence_workload(1) == 24577
    assert sequence_workload(1000) == 24576 * 1000 + 1000**2
    with pytest.raises(ValueError, match="length must be >= 0"):
        sequence_workload(-1)


def test_karmarkar_karp_matches_the_largest_differencing_method() -> None:
    values = [8, 7, 6, 5, 4]
    parts = karmarkar_karp_partition(values, 2, equal_size=False)
    assert sums(parts, values) == [16, 14]
    assert karmarkar_karp_partition(values, 2, equal_size=False) == parts
    three_way = [5, 5, 4, 3, 3, 3, 2, 2, 1, 1, 1]
    assert sums(karmarkar_karp_partition(three_way, 3, equal_size=False), three_way) == [10, 10, 10]


def test_karmarkar_karp_equal_size_needs_divisible_counts() -> None:
    with pytest.raises(ValueError, match=r"item count \(5\) to be divisible by num_partitions \(2\)"):
        karmarkar_karp_partition([1, 2, 3, 4, 5], 2)
    assert karmarkar_karp_partition([], 3) == [[], [], []]


workload_lists = st.lists(st.integers(0, 10_000), min_size=0, max_size=64)


@settings(max_examples=150, deadline=None)
@given(values=workload_lists, num_partitions=st.integers(1, 8))
def test_karmarkar_karp_equal_size_covers_and_beats_round_robin(values: list[int], num_partitions: int) -> None:
    values = values[: len(values) - len(values) % num_partitions]
    parts = karmarkar_karp_partition(values, num_partitions, equal_size=True)
    assert len(parts) == num_partitions
    assert_exact_cover(parts, len(values))
    assert all(len(part) == len(values) // num_partitions for part in parts)
    assert all(part == sorted(part) for part in parts)
    if values:
        by_size = sorted(range(len(values)), key=lambda i: values[i], reverse=True)
        round_robin = [by_size[rank::num_partitions] for rank in range(num_partitions)]
        assert spread(parts, values) <= spread(round_robin, values)


@settings(max_examples=150, deadline=None)
@given(values=workload_lists, num_partitions=st.integers(1, 8))
def test_karmarkar_karp_free_size_covers_and_leaves_no_needless_empty_part(
    values: list[int], num_partitions: int
) -> None:
    parts = karmarkar_karp_partition(values, num_partitions, equal_size=False)
    assert len(parts) == num_partitions
    assert_exact_cover(parts, len(values))
    positive = [v for v in values if v > 0]
    if len(positive) >= num_partitions and len(positive) == len(values):
        assert all(parts)
    if values:
        assert spread(parts, values) <= max(values)


def test_balance_across_dp_gives_equal_counts_and_balanced_work() -> None:
    lengths = [4096, 100, 100, 100, 2000, 2100, 50, 4000]
    ranks = balance_across_dp(lengths, 2)
    assert [len(rank) for rank in ranks] == [4, 4]
    assert_exact_cover(ranks, len(lengths))
    workloads = [sequence_workload(length) for length in lengths]
    assert spread(ranks, workloads) < 0.1 * sum(workloads)


def heaviest_and_lightest(parts: Sequence[Sequence[int]], values: Sequence[int]) -> tuple[list[int], list[int]]:
    totals = sums(parts, values)
    return list(parts[totals.index(max(totals))]), list(parts[totals.index(min(totals))])


@settings(max_examples=150, deadline=None)
@given(values=workload_lists, num_partitions=st.integers(1, 8))
def test_swaps_keep_counts_never_widen_and_stop_within_the_smallest_positive_difference(
    values: list[int], num_partitions: int
) -> None:
    values = values[: len(values) - len(values) % num_partitions]
    before = karmarkar_karp_partition(values, num_partitions, equal_size=True)
    # Unbounded: the sum of squared part sums falls with every swap, so the loop ends on its own.
    parts = refine_by_swaps(values, before, max_swaps=10**9)
    assert_exact_cover(parts, len(values))
    assert [len(part) for part in parts] == [len(part) for part in before]
    assert all(part == sorted(part) for part in parts)
    assert spread(parts, values) <= spread(before, values)
    heavy, light = heaviest_and_lightest(parts, values)
    positive = [values[a] - values[b] for a in heavy for b in light if values[a] > values[b]]
    if spread(parts, values) > 0:
        assert positive  # equal counts: some item of the heaviest part outweighs one of the lightest
        assert spread(parts, values) <= min(positive) <= max(values) - min(values)


def test_swaps_fix_the_group_that_straddles_a_long_tail() -> None:
    # Two ranks of three: Karmarkar-Karp's sorted groups (2, 2), (8, 8), (8, 20) leave 30 vs 18;
    # swapping an 8 of the heavy rank for a 2 of the light one (difference 6 = 12 / 2) evens them.
    values = [2, 2, 8, 8, 8, 20]
    before = karmarkar_karp_partition(values, 2)
    assert sums(before, values) == [30, 18]
    assert sums(refine_by_swaps(values, before, max_swaps=len(values)), values) == [24, 24]
    # Equal counts bound it: four ranks of two, one holds two 100s whatever the swaps (spread 99,
    # the smallest positive difference between its items and the lightest rank's).
    tail = [1, 1, 1, 100, 100, 100, 100, 100]
    parts = refine_by_swaps(tail, karmarkar_karp_partition(tail, 4), max_swaps=len(tail))
    assert sorted(sums(parts, tail)) == [101, 101, 101, 200]


def test_balance_across_dp_refuses_indivisible_batches() -> None:
    with pytest.raises(ValueError, match="batch of 10 sequences evenly across dp_size=4"):
        balance_across_dp([1] * 10, 4)


@settings(max_examples=150, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 300), min_size=1, max_size=48),
    extra_budget=st.integers(0, 600),
    min_fraction=st.floats(0.0, 1.0),
)
def test_micro_batches_cover_fit_the_budget_and_honour_the_minimum(
    lengths: list[int], extra_budget: int, min_fraction: float
) -> None:
    budget = max(lengths) + extra_budget
    minimum = max(1, int(min_fraction * len(lengths)))
    batches = token_budget_micro_batches(lengths, budget, min_num_micro_batches=minimum)
    assert_exact_cover(batches, len(lengths))
    assert all(batches) and max(sums(batches, lengths)) <= budget
    assert len(batches) >= max(minimum, -(-sum(lengths) // budget))
    assert len(batches) <= max(minimum, first_fit_decreasing_count(lengths, budget))
    assert sums(batches, lengths) == sorted(sums(batches, lengths), reverse=True)


def test_every_rank_gets_the_same_count_after_the_max_protocol() -> None:
    per_rank = [[100, 900, 50, 700], [1000, 1000, 1000, 10], [5, 5, 5, 5]]
    local_counts = [len(token_budget_micro_batches(lengths, 1024)) for lengths in per_rank]
    assert local_counts == [2, 3, 1]
    agreed = max(local_counts)
    assert [len(token_budget_micro_batches(lengths, 1024, agreed)) for lengths in per_rank] == [3, 3, 3]


def test_falls_back_to_first_fit_decreasing_when_balanced_split_overflows() -> None:
    lengths = [2, 2, 6, 3, 3, 2, 2, 3]
    batches = token_budget_micro_batches(lengths, 6)
    assert len(batches) == 4
    assert_exact_cover(batches, len(lengths))
    assert max(sums(batches, lengths)) <= 6


def test_micro_batching_errors_name_the_offending_values() -> None:
    with pytest.raises(ValueError, match="sequence 1 has 2048 tokens, more than max_tokens_per_micro_batch=1024"):
        token_budget_micro_batches([10, 2048], 1024)
    with pytest.raises(ValueError, match="min_num_micro_batches=3 exceeds the 2 sequences"):
        token_budget_micro_batches([10, 20], 1024, min_num_micro_batches=3)
    with pytest.raises(ValueError, match="sequence 0 has length 0"):
        token_budget_micro_batches([0, 5], 1024)
