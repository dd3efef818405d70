"""Dynamic sampling's selection and counts do not depend on the order in which requests complete."""

from __future__ import annotations

import itertools

from megatron_rl.rollout.groups import RolloutGroup, RolloutSample
from megatron_rl.rollout.manager import _OrderedSelection

SIGNAL = [False, True, False, True, True, False, True, True]  # position -> the group has signal
FAILURES = {1: ["error"], 2: ["timeout", "error"], 6: ["timeout"]}  # position -> its responses' reward failures
NEEDED = 3


def _samples(position: int) -> list[RolloutSample]:
    failures = FAILURES.get(position, [])
    return [
        RolloutSample([1], [2], [0.0], "stop", -1.0, False, 0.0, [1], None, reward_failure=failure)
        for failure in [*failures, *[None] * (4 - len(failures))]
    ]


def _select(order: tuple[int, ...], aborted_by_engine: frozenset[int] = frozenset()) -> tuple[list[str], dict]:
    kept: list[RolloutGroup] = []
    counts = {"aborted": 0, "dropped": 0, "samples": 0, "reward_errors": 0, "reward_timeouts": 0}
    selection = _OrderedSelection(len(SIGNAL), kept, NEEDED, counts)
    for position in order:
        if position in aborted_by_engine or position >= selection.cutoff:
            selection.discard(position)
        else:
            selection.decide(position, RolloutGroup(f"g{position}", position, _samples(position)), SIGNAL[position])
    selection.finish()
    return [g.uid for g in kept], counts


def test_every_completion_order_keeps_the_same_groups_and_counts() -> None:
    outcomes = {repr(_select(order)) for order in itertools.permutations(range(8))}
    assert len(outcomes) == 1
    kept, counts = _select(tuple(range(8)))
    assert kept == ["g1", "g3", "g4"]
    # Positions 0 and 2 were dropped (their 8 responses counted with the kept 12); 5..7 are surplus,
    # so the reward failure at position 6 is not counted.
    assert counts == {"aborted": 3, "dropped": 2, "samples": 20, "reward_errors": 2, "reward_timeouts": 1}


def test_a_request_the_engine_aborted_before_the_cutoff_counts_as_aborted() -> None:
    kept, counts = _select(tuple(reversed(range(8))), aborted_by_engine=frozenset({3}))
    assert kept == ["g1", "g4", "g6"]
    assert counts == {"aborted": 2, "dropped": 3, "samples": 24, "reward_errors": 2, "reward_timeouts": 2}
