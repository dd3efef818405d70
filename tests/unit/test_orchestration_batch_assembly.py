"""Rollout groups -> advantages, the actor's batch and the step's rollout metrics (hand-built groups)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from megatron_rl.orchestration.batch_assembly import (
    assemble_step_data,
    group_advantages,
    rollout_metrics,
    trim_to_even_split,
)
from megatron_rl.rollout.groups import RolloutGroup, RolloutSample


def _sample(prompt, response, score, *, finish="stop", loss_mask=None, routed=None) -> RolloutSample:
    return RolloutSample(
        prompt_ids=list(prompt),
        response_ids=list(response),
        rollout_logprobs=[-0.1 * (i + 1) for i in range(len(response))],
        finish_reason=finish,
        score=score,
        correct=score > 0,
        overlong_penalty=0.0,
        loss_mask=[1] * len(response) if loss_mask is None else loss_mask,
        weight_version="0",
        routed_experts=routed,
    )


def _groups() -> list[RolloutGroup]:
    return [
        RolloutGroup("g0", 3, [_sample([5, 6], [7, 1], 1.0), _sample([5, 6], [8, 8, 8], -1.0, finish="length")]),
        RolloutGroup("g1", 4, [_sample([9], [2], 1.0), _sample([9], [3, 1], 1.0), _sample([9], [4], -1.0)]),
    ]


def test_advantages_are_group_relative_by_uid() -> None:
    grpo = group_advantages(_groups(), norm_by_std=True)
    drgrpo = group_advantages(_groups(), norm_by_std=False)
    std_g1 = torch.tensor([1.0, 1.0, -1.0]).std().item()
    torch.testing.assert_close(drgrpo, torch.tensor([1.0, -1.0, 2 / 3, 2 / 3, -4 / 3]))
    expected = [1 / (math.sqrt(2) + 1e-6), -1 / (math.sqrt(2) + 1e-6)] + [
        a / (std_g1 + 1e-6) for a in (2 / 3, 2 / 3, -4 / 3)
    ]
    torch.testing.assert_close(grpo, torch.tensor(expected))


def test_step_data_is_ragged_and_compact() -> None:
    step = assemble_step_data(_groups(), torch.arange(5.0))
    assert step.token_ids.dtype == torch.int32 and step.token_ids.tolist() == [
        5,
        6,
        7,
        1,
        5,
        6,
        8,
        8,
        8,
        9,
        2,
        9,
        3,
        1,
        9,
        4,
    ]
    assert step.offsets.tolist() == [0, 4, 9, 11, 14, 16] and step.prompt_lengths.tolist() == [2, 2, 1, 1, 1]
    assert step.rollout_log_probs is not None
    assert step.rollout_log_probs.numel() == step.loss_mask.numel() == 9  # response tokens only
    assert step.mini_batch_sizes == (5,) and step.sample_ids.tolist() == [0, 1, 2, 3, 4]


def test_actor_batch_aligns_responses_log_probs_and_mask_after_the_prompt() -> None:
    groups = _groups()
    groups[0].samples[1].loss_mask = [0, 0, 0]  # overlong-filtered
    batch = assemble_step_data(groups, torch.arange(5.0)).to_actor_batch(pad_token_id=0)
    assert batch.input_ids.tolist() == [
        [5, 6, 7, 1, 0],
        [5, 6, 8, 8, 8],
        [9, 2, 0, 0, 0],
        [9, 3, 1, 0, 0],
        [9, 4, 0, 0, 0],
    ]
    assert batch.lengths.tolist() == [4, 5, 2, 3, 2]
    assert batch.response_mask.tolist()[0] == [False, False, True, True, False]
    assert not batch.response_mask[1].any()
    assert batch.response_mask.tolist()[3] == [False, True, True, False, False]
    assert batch.rollout_log_probs is not None and batch.advantages is not None
    torch.testing.assert_close(batch.rollout_log_probs[3], torch.tensor([0.0, -0.1, -0.2, 0.0, 0.0]))
    assert batch.advantages.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert batch.routed_experts is None


def test_routed_experts_travel_compact_and_are_padded_with_distinct_experts() -> None:
    routed = [
        np.full((len(p) + len(r) - 1, 2, 2), i, dtype=np.int32)
        for i, (p, r) in enumerate([([1, 2], [3]), ([4], [5, 6])])
    ]
    groups = [
        RolloutGroup(
            "g", 0, [_sample([1, 2], [3], 1.0, routed=routed[0]), _sample([4], [5, 6], -1.0, routed=routed[1])]
        )
    ]
    step = assemble_step_data(groups, torch.zeros(2), expert_dtype=torch.uint8)
    assert step.routed_experts is not None
    assert step.routed_experts.dtype == torch.uint8 and tuple(step.routed_experts.shape) == (4, 2, 2)
    batch = step.to_actor_batch()
    assert batch.routed_experts is not None
    assert tuple(batch.routed_experts.shape) == (2, 3, 2, 2) and batch.routed_experts.dtype == torch.long
    assert batch.routed_experts[1, :2].eq(1).all() and batch.routed_experts[0, :2].eq(0).all()
    assert batch.routed_experts[1, 2].tolist() == [[0, 1], [0, 1]]  # no expert recorded: distinct indices


def test_advantages_of_the_wrong_size_are_refused() -> None:
    with pytest.raises(ValueError, match=r"advantages must be \[B\] = \(5,\)"):
        assemble_step_data(_groups(), torch.zeros(4))


def test_rollout_metrics_report_reward_accuracy_and_length_bias() -> None:
    metrics = rollout_metrics(_groups(), max_response_length=3)
    assert metrics["train/reward_mean"] == pytest.approx(0.2)
    assert metrics["train/accuracy"] == pytest.approx(0.6)
    assert metrics["train/response_length_mean"] == pytest.approx(9 / 5)
    assert metrics["train/length_correct_mean"] == pytest.approx(5 / 3)
    assert metrics["train/length_wrong_mean"] == pytest.approx(2.0)
    assert metrics["train/truncation_rate"] == pytest.approx(0.2)
    assert set(rollout_metrics(_groups(), max_response_length=3, prefix="val")) == {
        k.replace("train/", "val/") for k in metrics
    }


def _uniform_groups(count: int, size: int) -> list[RolloutGroup]:
    return [RolloutGroup(f"g{i}", i, [_sample([1], [2], 1.0) for _ in range(size)]) for i in range(count)]


def test_a_partial_step_is_trimmed_to_what_splits_over_mini_batches_and_dp() -> None:
    groups = _uniform_groups(501, 16)  # 501 groups of 16 at 16 mini-batches x DP 8: 128 responses a unit
    kept = trim_to_even_split(groups, 16 * 8)
    assert len(kept) == 496 and kept == groups[:496] and 496 * 16 % 128 == 0
    assert trim_to_even_split(_uniform_groups(3, 8), 16) == _uniform_groups(3, 8)[:2]
    assert trim_to_even_split(_uniform_groups(1, 8), 16) == []
    assert trim_to_even_split([], 16) == []


def test_the_advantage_estimator_comes_from_the_registry() -> None:
    assert torch.equal(
        group_advantages(_groups(), estimator="grpo", norm_by_std=True), group_advantages(_groups(), norm_by_std=True)
    )
    with pytest.raises(ValueError, match="unknown advantage estimator 'nope'; registered: \\('grpo',\\)"):
        group_advantages(_groups(), estimator="nope", norm_by_std=True)
