"""Partial rollouts' bookkeeping: window budgets, continuation requests and seeds, merged responses."""

from __future__ import annotations

import numpy as np

from megatron_rl.data import PromptItem
from megatron_rl.engines.protocol import FinishReason, GenerateResult, SamplingParams
from megatron_rl.rollout.partial import (
    PartialGroup,
    PartialSample,
    WindowPlan,
    continuation_requests,
    continuation_seed,
)

LENGTH, STOP = FinishReason("length"), FinishReason("stop", matched=2)


def _result(tokens: list[int], reason: FinishReason, version: str | None) -> GenerateResult:
    routing = np.full((len(tokens), 1, 1), len(tokens), dtype=np.int32)
    return GenerateResult(tokens, [-0.5] * len(tokens), reason, 3, version, routed_experts=routing)


def test_each_window_is_capped_except_the_last_and_never_past_the_response_budget() -> None:
    plan = WindowPlan(tokens=4, max_windows=3, max_response_length=12)
    assert plan.budget(0, 0) == (4, True)
    assert plan.budget(4, 1) == (4, True)
    assert plan.budget(8, 2) == (4, False)  # the last window: whatever is left, uncapped
    assert WindowPlan(5, 3, 12).budget(10, 1) == (2, False)  # the budget, not the window, caps it
    assert WindowPlan(None, 3, 12).budget(0, 0) == (12, False)


def test_a_response_cut_by_its_window_stays_unfinished_and_merges_its_windows_in_order() -> None:
    sample = PartialSample()
    sample.extend(_result([5, 6, 7, 8], LENGTH, "default"), capped=True, max_response_length=12)
    assert not sample.finished
    sample.extend(_result([9, 2], STOP, "3"), capped=True, max_response_length=12)
    finished: bool = sample.finished  # extend() set it again; mypy would keep the narrowing of the assert above
    assert finished
    assert sample.output_ids == [5, 6, 7, 8, 9, 2] and sample.output_logprobs == [-0.5] * 6
    assert sample.finish_reason == STOP and sample.weight_version == "3"
    assert sample.version_segments == [("default", 4), ("3", 2)]
    assert sample.routed_experts is not None
    assert sample.routed_experts.shape == (2, 1, 1)  # the last window's routing (its prefill covers the rest)


def test_a_response_ends_at_its_budget_or_when_no_window_capped_it() -> None:
    at_budget = PartialSample()
    at_budget.extend(_result([1] * 4, LENGTH, None), capped=True, max_response_length=4)
    assert at_budget.finished
    uncapped = PartialSample()
    uncapped.extend(_result([1] * 3, LENGTH, None), capped=False, max_response_length=12)
    assert uncapped.finished


def test_continuations_are_one_request_per_unfinished_response_with_its_own_seed() -> None:
    item = PromptItem(7, [101, 102], "x", "test")
    done, cut_a, cut_b = PartialSample(), PartialSample(), PartialSample()
    done.extend(_result([2], STOP, "1"), capped=True, max_response_length=12)
    cut_a.extend(_result([3, 4, 5, 6], LENGTH, "1"), capped=True, max_response_length=12)
    cut_b.extend(_result([7, 8, 9, 10], LENGTH, "1"), capped=True, max_response_length=12)
    group = PartialGroup(item, "g7", 99, [done, cut_a, cut_b], windows=1)
    params = SamplingParams(max_new_tokens=0, temperature=0.7, n=3, sampling_seed=None)
    planned = continuation_requests(group, WindowPlan(4, 3, 12), params, routing_replay=True)
    assert [index for index, _, _ in planned] == [1, 2]
    for index, request, capped in planned:
        assert capped
        assert request.input_ids == [101, 102, *group.samples[index].output_ids]
        assert request.rid == f"g7.1.{index}"
        assert request.sampling_params.n == 1 and request.sampling_params.max_new_tokens == 4
        assert request.sampling_params.temperature == 0.7
        assert request.sampling_params.sampling_seed == continuation_seed(99, index, 1)
        assert request.return_routed_experts
    assert group.oldest_version() == 1


def test_continuation_seeds_are_deterministic_distinct_and_fit_in_int64() -> None:
    seeds = {
        continuation_seed(1234 * 2**32 + serial, sample, window)
        for serial in range(50)
        for sample in range(16)
        for window in range(1, 4)
    }
    assert len(seeds) == 50 * 16 * 3
    assert all(0 <= seed < 2**63 for seed in seeds)
    assert continuation_seed(5, 1, 1) == continuation_seed(5, 1, 1)
