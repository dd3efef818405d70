"""Reward functions with injected faults, imported by path in reward worker processes.

Each scores like the synthetic tasks' reward (+1 for exactly the answer, else -1) and misbehaves
on responses that carry a marker word, so one test can mix good, failing and hung responses.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

from megatron_rl.data import RewardOutput, synthetic_exact

RAISE = "boom"
"""A response containing this word makes :func:`faulty_exact` raise."""
HANG = "hang"
"""... sleep far past any reward timeout."""
EXIT = "exit"
"""... kill its own worker process."""


def faulty_exact(response: str, ground_truth: str, extra_info: Mapping[str, Any]) -> RewardOutput:
    """+1 when the response is exactly the ground truth, -1 otherwise; faults on the marker words."""
    if RAISE in response:
        raise ValueError(f"verifier crashed on {response!r}")
    if HANG in response:
        time.sleep(3600)
    if EXIT in response:
        os._exit(3)
    correct = response.strip() == ground_truth
    return RewardOutput(score=1.0 if correct else -1.0, correct=correct, answer=response.strip() or None)


def zero_one_faulty(response: str, ground_truth: str, extra_info: Mapping[str, Any]) -> RewardOutput:
    """1 when exactly right, 0 otherwise (a wrong answer scores 0); raises on the marker word."""
    if RAISE in response:
        raise KeyError("difficulty")
    correct = response.strip() == ground_truth
    return RewardOutput(score=1.0 if correct else 0.0, correct=correct)


def tiny_run_faulty(response: str, ground_truth: str, extra_info: Mapping[str, Any]) -> RewardOutput:
    """The tiny run's successor reward, raising on responses that start with 7 and hanging on those that
    start with 8 when the answer is 1 (rarer: each hang costs the timeout and a new worker)."""
    tokens = response.split()
    if tokens[:1] == ["7"]:
        raise RuntimeError("injected reward failure")
    if tokens[:1] == ["8"] and ground_truth == "1":
        time.sleep(3600)
    return synthetic_exact(response, ground_truth, extra_info)
