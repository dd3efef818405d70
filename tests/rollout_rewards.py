"""Reward functions for rollout tests (module level: reward workers import them by path)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from megatron_rl.data import RewardOutput


def first_token_parity(response: str, ground_truth: str, extra_info: Mapping[str, Any]) -> RewardOutput:
    """``constant`` prompts always score 1 (no signal); ``mixed`` ones score the first token id's parity.

    The empty response scores 0 (wrong), as the reward contract requires.
    """
    if not response:
        return RewardOutput(score=0.0, correct=False)
    if ground_truth == "constant":
        return RewardOutput(score=1.0, correct=True)
    odd = int(response.split()[0]) % 2 == 1
    return RewardOutput(score=1.0 if odd else 0.0, correct=odd)
