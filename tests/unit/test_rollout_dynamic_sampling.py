"""DAPO's dynamic sampling keeps a group when 0 < #correct < G (metric acc, the default); metric score keeps
groups whose shaped scores differ (verl's metric=score)."""

from __future__ import annotations

import torch

from megatron_rl.algorithms import grpo_advantages
from megatron_rl.config.schema import DynamicSamplingConfig
from megatron_rl.rollout.group_assembler import group_has_signal
from megatron_rl.rollout.groups import RolloutGroup, RolloutSample


def _sample(correct: bool, penalty: float = 0.0) -> RolloutSample:
    return RolloutSample(
        prompt_ids=[1],
        response_ids=[2, 3],
        rollout_logprobs=[-0.1, -0.2],
        finish_reason="stop",
        score=(1.0 if correct else -1.0) + penalty,
        correct=correct,
        overlong_penalty=penalty,
        loss_mask=[1, 1],
        weight_version="0",
    )


def _group(*samples: RolloutSample) -> RolloutGroup:
    return RolloutGroup("g0", 0, list(samples))


def test_accuracy_is_the_default_metric() -> None:
    assert DynamicSamplingConfig().metric == "acc"


def test_all_wrong_answers_with_an_overlong_penalty_are_dropped_on_accuracy_kept_on_score() -> None:
    group = _group(*[_sample(False)] * 15, _sample(False, penalty=-0.25))  # one wrong answer in the overlong buffer
    advantages = grpo_advantages(torch.tensor(group.scores), [0] * 16)
    assert advantages[:15].min() > 0  # what metric=score would train on: 15 wrong answers reinforced
    assert not group_has_signal(group, "acc")
    assert group_has_signal(group, "score")


def test_mixed_correctness_is_kept_and_all_correct_is_dropped() -> None:
    assert group_has_signal(_group(_sample(True), _sample(False)), "acc")
    assert group_has_signal(_group(_sample(True), _sample(False)), "score")
    all_correct = _group(_sample(True), _sample(True, penalty=-0.5))
    assert not group_has_signal(all_correct, "acc") and group_has_signal(all_correct, "score")
