"""Seeded prompt sampler: determinism, drop_last epochs, exact resume mid-epoch and across epochs."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_rl.data import PromptSampler


def take(sampler: PromptSampler, steps: int) -> list[list[int]]:
    return [sampler.next_batch() for _ in range(steps)]


def test_same_seed_gives_same_batches_and_other_seed_differs() -> None:
    assert take(PromptSampler(50, 8, seed=3), 20) == take(PromptSampler(50, 8, seed=3), 20)
    assert take(PromptSampler(50, 8, seed=3), 20) != take(PromptSampler(50, 8, seed=4), 20)


def test_epochs_are_fresh_permutations_with_the_tail_dropped() -> None:
    sampler = PromptSampler(10, 3, seed=0)
    assert sampler.batches_per_epoch == 3
    for epoch in range(4):
        assert sampler.epoch == epoch
        batches = take(sampler, 3)
        flat = [index for batch in batches for index in batch]
        assert all(len(batch) == 3 for batch in batches)
        assert flat == sampler.epoch_order(epoch)[:9]
        assert sorted(sampler.epoch_order(epoch)) == list(range(10))
    assert sampler.epoch_order(0) != sampler.epoch_order(1)


def test_state_after_the_last_batch_of_an_epoch_points_at_the_next_epoch() -> None:
    sampler = PromptSampler(10, 3, seed=5)
    take(sampler, 2)
    assert sampler.state_dict() == {"epoch": 0, "position": 6, "seed": 5}
    take(sampler, 1)
    assert sampler.state_dict() == {"epoch": 1, "position": 0, "seed": 5}


@pytest.mark.parametrize("steps_before_save", [0, 1, 2, 3, 4, 7, 9])
def test_resume_yields_exactly_the_uninterrupted_batches(steps_before_save: int) -> None:
    reference = take(PromptSampler(10, 3, seed=11), 15)
    original = PromptSampler(10, 3, seed=11)
    take(original, steps_before_save)
    resumed = PromptSampler(10, 3, seed=999)
    resumed.load_state_dict(original.state_dict())
    assert take(resumed, 15 - steps_before_save) == reference[steps_before_save:]


@settings(max_examples=60, deadline=None)
@given(
    dataset_size=st.integers(1, 40),
    batch_fraction=st.floats(0.01, 1.0),
    seed=st.integers(0, 2**32 - 1),
    steps_before_save=st.integers(0, 30),
)
def test_resume_is_exact_for_any_size_seed_and_step(
    dataset_size: int, batch_fraction: float, seed: int, steps_before_save: int
) -> None:
    batch_size = max(1, int(dataset_size * batch_fraction))
    reference = take(PromptSampler(dataset_size, batch_size, seed=seed), steps_before_save + 5)
    original = PromptSampler(dataset_size, batch_size, seed=seed)
    take(original, steps_before_save)
    resumed = PromptSampler(dataset_size, batch_size)
    resumed.load_state_dict(original.state_dict())
    assert take(resumed, 5) == reference[steps_before_save:]
    assert all(len(set(batch)) == batch_size for batch in reference)


def test_without_shuffle_epochs_visit_in_order() -> None:
    sampler = PromptSampler(5, 2, shuffle=False)
    assert take(sampler, 4) == [[0, 1], [2, 3], [0, 1], [2, 3]]


def test_iteration_is_endless_and_matches_next_batch() -> None:
    iterator = iter(PromptSampler(6, 4, seed=1))
    assert [next(iterator) for _ in range(3)] == take(PromptSampler(6, 4, seed=1), 3)


def test_invalid_arguments_and_states_are_refused() -> None:
    with pytest.raises(ValueError, match="dataset_size=3 is smaller than batch_size=4"):
        PromptSampler(3, 4)
    with pytest.raises(ValueError, match="seed must be >= 0"):
        PromptSampler(3, 1, seed=-1)
    sampler = PromptSampler(10, 2)
    with pytest.raises(ValueError, match=r"missing \['seed'\]"):
        sampler.load_state_dict({"epoch": 0, "position": 0})
    with pytest.raises(ValueError, match="position=12 .*dataset_size=10"):
        sampler.load_state_dict({"epoch": 0, "position": 12, "seed": 0})
