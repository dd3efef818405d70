"""Which groups a training step keeps: dynamic sampling's decisions in submission order, and their counts.

Groups are decided as if they had come back one by one in the order they were sent, whatever order
they come back in, so a step's groups and counts depend only on the prompts and the engines' outputs.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_rl.rollout.groups import RolloutGroup, ToolCounts
from megatron_rl.rollout.partial import PartialGroup


@dataclass
class SelectionCounts:
    """A step's counts over its settled positions (so they do not depend on timing either)."""

    aborted: int = 0
    """Positions past the cutoff (surplus) and settled requests an engine aborted."""
    dropped: int = 0
    """Settled groups without signal."""
    samples: int = 0
    """The responses of the settled groups, kept or dropped."""
    reward_errors: int = 0
    """Responses of settled groups whose reward raised (or killed its worker)."""
    reward_timeouts: int = 0
    """Responses of settled groups whose reward ran past its timeout."""
    tools: ToolCounts = ToolCounts()
    """The tool calls the responses of settled groups made (multi-turn episodes), and their failures."""


class StepSelection:
    """Keeps a step's groups in submission order, round by round, until ``needed`` are kept.

    A round is a run of positions 0..size-1 (carried groups' next windows, then new prompts; a round may
    grow while it runs, :meth:`extend`). A group at position p is kept when it has signal and fewer than
    ``needed`` groups were kept before it (in this round or an earlier one); once the step is full at
    position p, ``cutoff`` becomes p + 1 and later positions are surplus (aborted). A group still
    generating (partial rollouts) settles as carried: it joins the round's unfinished groups in position
    order, as do, at :meth:`finish_round`, the continued groups past the cutoff, unchanged.
    """

    def __init__(self, needed: int) -> None:
        self.needed = needed
        self.kept: list[RolloutGroup] = []
        self.counts = SelectionCounts()
        self.begin_round(0)

    @property
    def full(self) -> bool:
        """Whether ``needed`` groups are kept."""
        return len(self.kept) >= self.needed

    def begin_round(self, size: int) -> None:
        """Start a round of ``size`` positions; kept groups and counts go on from the rounds before."""
        self.cutoff = self._size = size
        self._unfinished: list[PartialGroup] = []
        self._outcomes: dict[int, tuple[RolloutGroup | PartialGroup | None, bool]] = {}
        self._settled = 0
        self._waiting_unkept = 0  # outcomes waiting to settle that will not be kept

    def discard(self, position: int) -> None:
        """The request at ``position`` was aborted or is surplus (past the cutoff: counted by :meth:`finish_round`)."""
        if position < self.cutoff:
            self._record(position, None, False)

    def decide(self, position: int, group: RolloutGroup, has_signal: bool) -> None:
        """The scored group at ``position``; dynamic sampling drops it when it has no signal."""
        self._record(position, group, has_signal)

    def carry(self, position: int, group: PartialGroup) -> None:
        """The group at ``position`` has responses still generating: it goes on in the next round or step."""
        if position < self.cutoff:
            self._record(position, group, False)

    def cannot_fill(self) -> bool:
        """Whether the step stays short of ``needed`` even if every position not yet known to be dropped,
        discarded or carried is kept: the next generation batch is then certain to be needed. O(1)."""
        possible = self._size - self._settled - self._waiting_unkept
        return len(self.kept) + possible < self.needed

    def extend(self, count: int) -> None:
        """Append ``count`` positions to the round (a generation batch taken while it runs); only while
        :meth:`cannot_fill`, when no cutoff has been set (``cutoff`` is the size)."""
        self._size += count
        self.cutoff = self._size

    def finish_round(self, continued: dict[int, PartialGroup]) -> list[PartialGroup]:
        """The round is over: positions past the cutoff count as aborted, except the ``continued`` groups
        (by position), which stay carried as they were. Returns the round's unfinished groups, in order."""
        for position in range(self.cutoff, self._size):
            if position in continued:
                self._unfinished.append(continued[position])
            else:
                self.counts.aborted += 1
        return self._unfinished

    def _record(self, position: int, group: RolloutGroup | PartialGroup | None, has_signal: bool) -> None:
        self._outcomes[position] = (group, has_signal)
        self._waiting_unkept += not has_signal
        self._settle()

    def _settle(self) -> None:
        while self._settled < self.cutoff and self._settled in self._outcomes:
            group, has_signal = self._outcomes.pop(self._settled)
            self._settled += 1
            self._waiting_unkept -= not has_signal
            if group is None:
                self.counts.aborted += 1
            elif isinstance(group, PartialGroup):
                self._unfinished.append(group)
            else:
                self._count(group)
                if not has_signal:
                    self.counts.dropped += 1
                    continue
                self.kept.append(group)
                if self.full:
                    self.cutoff = self._settled

    def _count(self, group: RolloutGroup) -> None:
        """Count a settled group's responses, their tool calls and their reward failures."""
        self.counts.samples += len(group.samples)
        for sample in group.samples:
            self.counts.tools += sample.tools
            if sample.reward_failure == "error":
                self.counts.reward_errors += 1
            elif sample.reward_failure == "timeout":
                self.counts.reward_timeouts += 1
