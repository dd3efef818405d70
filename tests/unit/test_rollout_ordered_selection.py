"""Dynamic sampling's selection and counts do not depend on the order in which requests complete."""

from __future__ import annotations

import itertools

from megatron_rl.rollout.groups import RolloutGroup
from megatron_rl.rollout.manager import _OrderedSelection

SIGNAL = [False, True, False, True, True, False, True, True]  # position -> the group has signal
NEEDED = 3


def _select(order: tuple[int, ...], aborted_by_engine: frozenset[int] = frozenset()) -> tuple[list[str], dict]:
    kept: list[RolloutGroup] = []
    counts = {"aborted": 0, "dropped": 0, "samples": 0}
    selection = _OrderedSelection(len(SIGNAL), kept, NEEDED, counts)
    for position in order:
        if position in aborted_by_engine or position >= selection.cutoff:
            selection.discard(position)
        else:
            selection.decide(position, RolloutGroup(f"g{position}", position, [None] * 4), SIGNAL[position])
    selection.finish()
    return [g.uid for g in kept], counts


def test_every_completion_order_keeps_the_same_groups_and_counts() -> None:
    outcomes = {repr(_select(order)) for order in itertools.permutations(range(8))}
    assert len(outcomes) == 1
    kept, counts = _select(tuple(range(8)))
    assert kept == ["g1", "g3", "g4"]
    # Positions 0 and 2 were dropped (their 8 responses counted with the kept 12); 5..7 are surplus.
    assert counts == {"aborted": 3, "dropped": 2, "samples": 20}


def test_a_request_the_engine_aborted_before_the_cutoff_counts_as_aborted() -> None:
    kept, counts = _select(tuple(reversed(range(8))), aborted_by_engine=frozenset({3}))
    assert kept == ["g1", "g4", "g6"]
    assert counts == {"aborted": 2, "dropped": 3, "samples": 24}
