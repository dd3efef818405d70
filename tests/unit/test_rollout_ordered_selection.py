"""Dynamic sampling's selection and counts do not depend on the order in which requests complete."""

from __future__ import annotations

import dataclasses
import itertools

from megatron_rl.data import PromptItem
from megatron_rl.rollout.groups import RolloutGroup, RolloutSample, ToolCounts
from megatron_rl.rollout.partial import PartialGroup, PartialSample
from megatron_rl.rollout.step_selection import StepSelection

SIGNAL = [False, True, False, True, True, False, True, True]  # position -> the group has signal
FAILURES = {1: ["error"], 2: ["timeout", "error"], 6: ["timeout"]}  # position -> its responses' reward failures
TOOL_FAILURES = {0: "errors", 1: "limit_stops", 2: "timeouts"}  # position -> what each response's
# second tool call met (every response makes two calls)
NEEDED = 3


def _samples(position: int) -> list[RolloutSample]:
    failures = FAILURES.get(position, [])
    tools = ToolCounts(calls=2, **({TOOL_FAILURES[position]: 1} if position in TOOL_FAILURES else {}))
    return [
        RolloutSample([1], [2], [0.0], "stop", -1.0, False, 0.0, [1], None, reward_failure=failure, tools=tools)
        for failure in [*failures, *[None] * (4 - len(failures))]
    ]


def _selection(size: int, needed: int) -> StepSelection:
    """A step's selection of ``needed`` groups in its first round, of ``size`` positions."""
    selection = StepSelection(needed)
    selection.begin_round(size)
    return selection


def _select(order: tuple[int, ...], aborted_by_engine: frozenset[int] = frozenset()) -> tuple[list[str], dict]:
    selection = _selection(len(SIGNAL), NEEDED)
    for position in order:
        if position in aborted_by_engine or position >= selection.cutoff:
            selection.discard(position)
        else:
            selection.decide(position, RolloutGroup(f"g{position}", position, _samples(position)), SIGNAL[position])
    selection.finish_round({})
    return [g.uid for g in selection.kept], dataclasses.asdict(selection.counts)


def _partial(position: int) -> PartialGroup:
    return PartialGroup(PromptItem(position, [1], "1", "test"), f"g{position}", None, [PartialSample()])


# Partial rollouts: positions 0-2 continue groups carried from the step before; "carry" groups have a
# response still generating after this window.
PARTIAL_OUTCOMES = ["keep", "carry", "keep", "drop", "carry", "keep", "keep", "carry"]


def _select_partial(order: tuple[int, ...], needed: int) -> tuple[list[str], list[str], dict]:
    selection = _selection(len(PARTIAL_OUTCOMES), needed)
    for position in order:
        outcome = PARTIAL_OUTCOMES[position]
        if position >= selection.cutoff:
            selection.discard(position)
        elif outcome == "carry":
            selection.carry(position, _partial(position))
        else:
            group = RolloutGroup(f"g{position}", position, _samples(position))
            selection.decide(position, group, outcome == "keep")
    unfinished = selection.finish_round({position: _partial(position) for position in range(3)})
    return [g.uid for g in selection.kept], [g.uid for g in unfinished], dataclasses.asdict(selection.counts)


def test_every_completion_order_keeps_the_same_groups_and_counts() -> None:
    outcomes = {repr(_select(order)) for order in itertools.permutations(range(8))}
    assert len(outcomes) == 1
    kept, counts = _select(tuple(range(8)))
    assert kept == ["g1", "g3", "g4"]
    # Positions 0 and 2 were dropped (their 8 responses counted with the kept 12); 5..7 are surplus,
    # so the reward failure at position 6 is not counted.
    assert counts == {"aborted": 3, "dropped": 2, "samples": 20, "reward_errors": 2, "reward_timeouts": 1} | {
        "tools": {"calls": 40, "errors": 4, "timeouts": 4, "limit_stops": 4},
    }


def test_a_request_the_engine_aborted_before_the_cutoff_counts_as_aborted() -> None:
    kept, counts = _select(tuple(reversed(range(8))), aborted_by_engine=frozenset({3}))
    assert kept == ["g1", "g4", "g6"]
    assert counts == {"aborted": 2, "dropped": 3, "samples": 24, "reward_errors": 2, "reward_timeouts": 2} | {
        "tools": {"calls": 48, "errors": 4, "timeouts": 4, "limit_stops": 4},
    }


def test_carried_groups_keep_their_order_whatever_the_completion_order() -> None:
    outcomes = {repr(_select_partial(order, needed=3)) for order in itertools.permutations(range(8))}
    assert len(outcomes) == 1
    kept, unfinished, counts = _select_partial(tuple(range(8)), needed=3)
    assert kept == ["g0", "g2", "g5"]
    assert unfinished == ["g1", "g4"]  # 6 and 7 are past the cutoff: new prompts, aborted
    # Position 1 is carried: its responses' tool calls are counted when its group settles in a later round.
    assert counts == {"aborted": 2, "dropped": 1, "samples": 16, "reward_errors": 1, "reward_timeouts": 1} | {
        "tools": {"calls": 32, "errors": 4, "timeouts": 4, "limit_stops": 0},
    }


def test_continued_groups_past_the_cutoff_stay_carried_unchanged() -> None:
    kept, unfinished, counts = _select_partial(tuple(reversed(range(8))), needed=1)
    assert kept == ["g0"]
    # The cutoff is position 1: the continued groups 1 and 2 go on in the next step as they were.
    assert unfinished == ["g1", "g2"]
    assert counts["aborted"] == 5


def _select_extended(order: tuple[int, ...]) -> tuple[list[str], dict, int]:
    """SIGNAL's positions in two batches of 4: the second is sent (the selection extended) as soon as the
    first cannot fill the step; ``order`` is the completion order of the requests sent. Returns the kept
    uids, the counts and how many of the first batch's groups were decided when the second was sent."""
    selection = _selection(4, NEEDED)
    waiting, sent, decided_when_sent = list(order), 4, -1
    while waiting:
        position = next(p for p in waiting if p < sent)
        waiting.remove(position)
        if position >= selection.cutoff:
            selection.discard(position)
        else:
            selection.decide(position, RolloutGroup(f"g{position}", position, _samples(position)), SIGNAL[position])
        if sent == 4 and selection.cannot_fill():
            selection.extend(4)
            sent, decided_when_sent = 8, 8 - len(waiting)
    selection.finish_round({})
    return [g.uid for g in selection.kept], dataclasses.asdict(selection.counts), decided_when_sent


def test_a_batch_sent_early_selects_as_one_batch_after_the_other() -> None:
    sequential = _select(tuple(range(8)))
    for order in itertools.permutations(range(8)):
        kept, counts, _ = _select_extended(order)
        assert (kept, counts) == sequential
    # The first batch keeps at most 2 of the 3 needed (positions 1 and 3): once 0 and 2 are known to be
    # dropped, the second batch is certain to be needed and goes out while 1 and 3 still generate.
    assert _select_extended((0, 2, 1, 3, 4, 5, 6, 7))[2] == 2
    assert _select_extended((1, 3, 0, 2, 4, 5, 6, 7))[2] == 4


def test_cannot_fill_counts_only_positions_that_may_still_be_kept() -> None:
    selection = _selection(3, 2)
    assert not selection.cannot_fill()
    selection.decide(2, RolloutGroup("g2", 2, _samples(2)), False)  # dropped, not yet settled
    assert not selection.cannot_fill()  # positions 0 and 1 may still both be kept
    selection.discard(1)
    assert selection.cannot_fill()
