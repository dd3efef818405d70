"""What a rollout step hands to the trainer: groups of scored samples, identified by uid."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class ToolCounts:
    """Tool calls and how many failed: ``errors`` (malformed, an unknown tool, a tool that raised or died),
    ``timeouts`` (past ``rollout.tool_timeout_s``), ``limit_stops`` (a limit of the tool stopped the work: the
    python tool's sandbox). Counts add up with ``+`` (a step's over its responses)."""

    calls: int = 0
    errors: int = 0
    timeouts: int = 0
    limit_stops: int = 0

    def after(self, tool: str | None, failure: str | None) -> ToolCounts:
        """These counts and one environment reply: a call of ``tool`` (None: no tool ran) that met ``failure``
        (``error``, ``timeout``, ``limit`` or None)."""
        return self + ToolCounts(tool is not None, failure == "error", failure == "timeout", failure == "limit")

    def __add__(self, other: ToolCounts) -> ToolCounts:
        return ToolCounts(*(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other), strict=True)))


@dataclass
class RolloutSample:
    """One response. ``loss_mask`` is 1 per response token (0 everywhere when overlong-filtered).

    ``score`` includes the overlong penalty (``overlong_penalty`` holds it alone);
    ``routed_experts`` is int32 ``[prompt + response - 1, layers, top_k]`` or None;
    ``reward_failure`` is ``"error"`` or ``"timeout"`` when the reward failed on this response
    (``score`` is then the reward's failed score), else None; ``answer`` is the reward's normal form of the
    response's final answer (None: it gave none, or the reward failed). ``version_segments`` is
    ``[(weight_version, tokens), ...]``: the engine-reported weight version each run of response
    tokens was sampled under, in order (one segment unless a partial rollout continued the response
    under newer weights; ``weight_version`` is the last segment's); empty means all of
    ``response_ids`` came from ``weight_version``.

    Multi-turn episodes: ``response_ids`` hold the model's turns and the environment's replies between
    them; ``policy_tokens`` counts the tokens the engine sampled (None: all of them), the replies' tokens
    have loss mask 0 and rollout log-prob 0.0; ``turns`` counts the model's turns, ``tools`` its tool calls.
    """

    prompt_ids: list[int]
    response_ids: list[int]
    rollout_logprobs: list[float]
    finish_reason: str
    score: float
    correct: bool
    overlong_penalty: float
    loss_mask: list[int]
    weight_version: str | None
    routed_experts: np.ndarray | None = None
    reward_failure: str | None = None
    version_segments: list[tuple[str | None, int]] = field(default_factory=list)
    policy_tokens: int | None = None
    turns: int = 1
    tools: ToolCounts = ToolCounts()
    answer: str | None = None

    @property
    def sampled_tokens(self) -> int:
        """How many response tokens the engine sampled (all of them unless an environment replied)."""
        return len(self.response_ids) if self.policy_tokens is None else self.policy_tokens

    @property
    def truncated(self) -> bool:
        """True when the response hit the length limit."""
        return self.finish_reason == "length"

    def token_versions(self) -> list[tuple[str | None, int]]:
        """``(weight_version, tokens)`` runs covering every response token (see ``version_segments``)."""
        return self.version_segments or [(self.weight_version, len(self.response_ids))]


@dataclass
class RolloutGroup:
    """The n samples of one prompt; ``uid`` is unique within the run, ``prompt_index`` is the dataset index."""

    uid: str
    prompt_index: int
    samples: list[RolloutSample]

    @property
    def scores(self) -> list[float]:
        """The samples' scores, in order."""
        return [s.score for s in self.samples]


@dataclass
class RolloutStep:
    """A step's kept groups and the rollout metrics (counts of kept/dropped/aborted groups among them)."""

    groups: list[RolloutGroup]
    metrics: dict[str, float] = field(default_factory=dict)


def weight_version_number(weight_version: str | None) -> int:
    """The step whose weights an engine-reported ``weight_version`` names (``default``, the initial weights: 0)."""
    return 0 if weight_version in (None, "default") else int(weight_version)
