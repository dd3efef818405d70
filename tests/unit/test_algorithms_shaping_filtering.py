"""DAPO overlong penalty (piecewise, at its boundaries) and the dynamic-sampling group filter."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_rl.algorithms import groups_with_signal, overlong_penalty


def test_overlong_penalty_piecewise_values_at_the_boundaries() -> None:
    # L_max 20, L_cache 4: free up to 16, linear to -1 at 20, -1 beyond.
    lengths = torch.tensor([0, 16, 17, 18, 20, 21, 100])
    penalty = overlong_penalty(lengths, max_response_length=20, buffer_length=4)
    assert penalty.tolist() == [0.0, 0.0, -0.25, -0.5, -1.0, -1.0, -1.0]
    assert penalty.dtype == torch.float32


def test_overlong_penalty_scales_with_factor() -> None:
    penalty = overlong_penalty(torch.tensor([16, 18, 30]), 20, 4, penalty_factor=2.0)
    assert penalty.tolist() == [0.0, -1.0, -2.0]


def test_overlong_buffer_as_long_as_budget_penalises_from_the_first_token() -> None:
    assert overlong_penalty(torch.tensor([0, 5, 10]), 10, 10).tolist() == [0.0, -0.5, -1.0]


@pytest.mark.parametrize(
    ("max_response_length", "buffer_length", "penalty_factor", "message"),
    [
        (20, 0, 1.0, "buffer_length"),
        (20, 21, 1.0, "buffer_length"),
        (20, -4, 1.0, "buffer_length"),
        (0, 4, 1.0, "max_response_length"),
        (20, 4, -1.0, "penalty_factor"),
    ],
)
def test_overlong_penalty_invalid_arguments_raise(
    max_response_length: int, buffer_length: int, penalty_factor: float, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        overlong_penalty(torch.tensor([1]), max_response_length, buffer_length, penalty_factor)


def test_overlong_penalty_rejects_2d_lengths() -> None:
    with pytest.raises(ValueError, match="lengths"):
        overlong_penalty(torch.ones(2, 2), 20, 4)


def test_groups_with_signal_with_interleaved_ids() -> None:
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0, 1.0])
    keep = groups_with_signal(scores, ["a", "b", "a", "c", "b", "c"])
    assert keep.tolist() == [True, False, True, False, False, False]


def test_groups_with_signal_tolerates_float_noise_only() -> None:
    scores = torch.tensor([0.5, 0.5 + 1e-7, 0.5, 0.5 + 1e-3])
    assert groups_with_signal(scores, torch.tensor([0, 0, 1, 1])).tolist() == [False, False, True, True]


def test_singleton_group_has_no_signal() -> None:
    assert groups_with_signal(torch.tensor([1.0, 0.0, 1.0]), ["solo", "pair", "pair"]).tolist() == [False, True, True]


def test_groups_with_signal_invalid_arguments_raise() -> None:
    with pytest.raises(ValueError, match="atol"):
        groups_with_signal(torch.zeros(2), ["a", "a"], atol=-1.0)
    with pytest.raises(ValueError, match="scores"):
        groups_with_signal(torch.zeros(2, 1), ["a", "a"])


@settings(max_examples=50, deadline=None)
@given(data=st.data())
def test_a_group_is_kept_exactly_when_its_scores_differ(data: st.DataObject) -> None:
    size = data.draw(st.integers(1, 20))
    scores = data.draw(st.lists(st.integers(0, 2), min_size=size, max_size=size))
    ids = data.draw(st.lists(st.integers(0, 4), min_size=size, max_size=size))
    keep = groups_with_signal(torch.tensor(scores, dtype=torch.float32), torch.tensor(ids))
    expected = [len({s for s, g in zip(scores, ids, strict=True) if g == uid}) > 1 for uid in ids]
    assert keep.tolist() == expected
