"""Reward scoring in worker processes, so a slow verifier does not stall generation.

Workers are started with ``spawn`` (the parent runs HTTP threads, which
``fork`` must not copy) and warmed up at construction, so the first step does
not pay their start-up. The reward is looked up by name
(:func:`megatron_rl.data.get_reward`: a registered name or ``pkg.module:fn``)
inside the worker, which keeps the task picklable.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from typing import Any


def score_responses(
    reward: str, responses: Sequence[str], ground_truth: str, extra_info: Mapping[str, Any]
) -> list[tuple[float, bool]]:
    """(score, correct) of each response of one group (runs in a worker)."""
    from megatron_rl.data import get_reward

    fn = get_reward(reward)
    outputs = [fn(response, ground_truth, extra_info) for response in responses]
    return [(output.score, output.correct) for output in outputs]


def _ready() -> bool:
    from megatron_rl.data import get_reward  # noqa: F401  (import the reward registry once per worker)

    return True


class RewardPool:
    """``num_workers`` spawned processes scoring groups with the reward named ``reward``."""

    def __init__(self, reward: str, num_workers: int) -> None:
        if num_workers < 1:
            raise ValueError(f"reward num_workers must be >= 1, got {num_workers}")
        self.reward = reward
        self._pool = ProcessPoolExecutor(num_workers, mp_context=multiprocessing.get_context("spawn"))
        for ready in [self._pool.submit(_ready) for _ in range(num_workers)]:
            ready.result()

    def submit(self, responses: Sequence[str], ground_truth: str, extra_info: Mapping[str, Any]) -> Future:
        """Future of :func:`score_responses` for one group."""
        return self._pool.submit(score_responses, self.reward, list(responses), ground_truth, dict(extra_info))

    def close(self) -> None:
        """Stop the workers (pending scores are cancelled)."""
        self._pool.shutdown(wait=True, cancel_futures=True)
