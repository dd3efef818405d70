"""GRPO / Dr.GRPO advantages: hand-computed values, grouping by id, permutation invariance."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_rl.algorithms import expand_to_tokens, grpo_advantages

EPS = 1e-6
ScoredGroups = tuple[list[float], list[int], list[int]]


def assert_values(actual: torch.Tensor, expected: list[float]) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), atol=1e-6, rtol=1e-5)


def test_grpo_advantages_match_hand_computed_values() -> None:
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 4.0])
    uids = ["a", "a", "a", "a", "b", "b"]
    # group a: mean 0.5, unbiased var (4 * 0.25) / 3, std 0.5773503
    # group b: mean 3, unbiased var (1 + 1) / 1, std 1.4142136
    a = 0.5 / (0.5773503 + EPS)
    b = 1.0 / (1.4142136 + EPS)
    assert_values(grpo_advantages(scores, uids), [a, -a, -a, a, -b, b])


def test_drgrpo_advantages_subtract_the_group_mean_only() -> None:
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 4.0])
    uids = ["a", "a", "a", "a", "b", "b"]
    assert_values(grpo_advantages(scores, uids, norm_by_std=False), [0.5, -0.5, -0.5, 0.5, -1.0, 1.0])


def test_interleaved_groups_are_identified_by_id_not_position() -> None:
    scores = torch.tensor([1.0, 10.0, 3.0, 30.0])
    uids = ["p1", "p2", "p1", "p2"]
    assert_values(grpo_advantages(scores, uids, norm_by_std=False), [-1.0, -10.0, 1.0, 10.0])
    # p1: deviations -1, +1, std sqrt(2); p2: deviations -10, +10, std sqrt(200)
    p1, p2 = 1 / (math.sqrt(2) + EPS), 10 / (math.sqrt(200) + EPS)
    assert_values(grpo_advantages(scores, uids), [-p1, -p2, p1, p2])


def test_integer_tensor_ids_group_like_string_ids() -> None:
    scores = torch.tensor([0.3, 2.0, 0.9, -1.0, 5.0])
    by_string = grpo_advantages(scores, ["x", "y", "x", "y", "z"])
    by_tensor = grpo_advantages(scores, torch.tensor([7, 3, 7, 3, 100]))
    torch.testing.assert_close(by_string, by_tensor)


@pytest.mark.parametrize("norm_by_std", [True, False])
def test_singleton_group_gets_zero_advantage(norm_by_std: bool) -> None:
    advantages = grpo_advantages(torch.tensor([5.0, 1.0, 3.0]), ["solo", "pair", "pair"], norm_by_std=norm_by_std)
    assert advantages[0].item() == 0.0


def test_group_with_equal_scores_gets_zero_advantage_not_nan() -> None:
    advantages = grpo_advantages(torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0]), ["a", "a", "a", "b", "b"])
    assert_values(advantages[:3], [0.0, 0.0, 0.0])
    assert torch.isfinite(advantages).all()


def test_advantages_are_float32_for_integer_or_bf16_scores() -> None:
    assert grpo_advantages(torch.tensor([0, 1]), ["a", "a"]).dtype == torch.float32
    assert grpo_advantages(torch.tensor([0.0, 1.0], dtype=torch.bfloat16), ["a", "a"]).dtype == torch.float32


@pytest.mark.parametrize(
    ("scores", "group_ids", "eps", "message"),
    [
        (torch.zeros(2, 2), ["a", "b"], EPS, "scores"),
        (torch.zeros(2), ["a", "b"], 0.0, "eps"),
        (torch.zeros(3), ["a", "b"], EPS, "group_ids"),
        (torch.zeros(2), "ab", EPS, "group_ids"),
        (torch.zeros(2), torch.tensor([0.0, 1.0]), EPS, "group_ids"),
    ],
)
def test_invalid_arguments_raise_value_error_naming_them(
    scores: torch.Tensor, group_ids: torch.Tensor | str | list[str], eps: float, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        grpo_advantages(scores, group_ids, eps=eps)


def test_expand_to_tokens_broadcasts_over_valid_tokens_only() -> None:
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    expanded = expand_to_tokens(torch.tensor([0.5, -2.0]), mask)
    torch.testing.assert_close(expanded, torch.tensor([[0.5, 0.5, 0.0], [-2.0, 0.0, 0.0]]))


@st.composite
def scored_groups(draw: st.DrawFn) -> ScoredGroups:
    size = draw(st.integers(min_value=1, max_value=24))
    scores = draw(st.lists(st.floats(-5, 5, width=32), min_size=size, max_size=size))
    ids = draw(st.lists(st.integers(0, 5), min_size=size, max_size=size))
    permutation = draw(st.permutations(range(size)))
    return scores, ids, permutation


@settings(max_examples=50, deadline=None)
@given(case=scored_groups(), norm_by_std=st.booleans())
def test_advantages_are_invariant_to_permuting_responses(case: ScoredGroups, norm_by_std: bool) -> None:
    scores, ids, permutation = case
    advantages = grpo_advantages(torch.tensor(scores), [f"uid-{i}" for i in ids], norm_by_std=norm_by_std)
    permuted = grpo_advantages(
        torch.tensor(scores)[permutation], [f"uid-{ids[j]}" for j in permutation], norm_by_std=norm_by_std
    )
    torch.testing.assert_close(permuted, advantages[permutation], atol=1e-5, rtol=1e-5)


@settings(max_examples=50, deadline=None)
@given(case=scored_groups())
def test_drgrpo_advantages_sum_to_zero_within_each_group(case: ScoredGroups) -> None:
    scores, ids, _ = case
    advantages = grpo_advantages(torch.tensor(scores), torch.tensor(ids), norm_by_std=False)
    for uid in set(ids):
        in_group = torch.tensor(ids) == uid
        assert abs(advantages[in_group].sum().item()) < 1e-4
