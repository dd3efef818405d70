"""Length-bias diagnostics: hand-computed values and the nan convention for undefined statistics."""

import math

import pytest
import torch

from megatron_rl.algorithms import length_bias_metrics

KEYS = {
    "length_mean",
    "length_correct_mean",
    "length_wrong_mean",
    "length_wrong_over_correct",
    "length_score_corr",
    "truncation_rate",
}
LENGTHS = torch.tensor([10, 20, 30, 40])
CORRECT = torch.tensor([True, True, False, False])
SCORES = torch.tensor([1.0, 1.0, 0.0, 0.0])


def test_length_bias_metrics_match_hand_computed_values() -> None:
    metrics = length_bias_metrics(LENGTHS, CORRECT, SCORES, max_response_length=30)
    assert metrics.keys() == KEYS
    assert metrics["length_mean"] == pytest.approx(25.0)
    assert metrics["length_correct_mean"] == pytest.approx(15.0)
    assert metrics["length_wrong_mean"] == pytest.approx(35.0)
    assert metrics["length_wrong_over_correct"] == pytest.approx(35 / 15)
    # dx = [-15, -5, 5, 15], dy = [.5, .5, -.5, -.5]: -20 / sqrt(500 * 1)
    assert metrics["length_score_corr"] == pytest.approx(-0.8944272)
    assert metrics["truncation_rate"] == pytest.approx(0.5)  # lengths >= 30
    assert all(type(value) is float for value in metrics.values())


def test_truncated_flags_take_precedence_over_max_length() -> None:
    truncated = torch.tensor([False, False, False, True])
    metrics = length_bias_metrics(LENGTHS, CORRECT, SCORES, max_response_length=30, truncated=truncated)
    assert metrics["truncation_rate"] == pytest.approx(0.25)


def test_empty_class_gives_nan_mean_and_ratio() -> None:
    metrics = length_bias_metrics(LENGTHS, torch.zeros(4, dtype=torch.bool), SCORES, max_response_length=64)
    assert math.isnan(metrics["length_correct_mean"])
    assert math.isnan(metrics["length_wrong_over_correct"])
    assert metrics["length_wrong_mean"] == pytest.approx(25.0)


def test_constant_scores_give_nan_correlation() -> None:
    metrics = length_bias_metrics(LENGTHS, CORRECT, torch.ones(4), max_response_length=64)
    assert math.isnan(metrics["length_score_corr"])


def test_empty_batch_gives_nan_everywhere_with_the_same_keys() -> None:
    empty = torch.zeros(0)
    metrics = length_bias_metrics(empty, empty.bool(), empty, max_response_length=64)
    assert metrics.keys() == KEYS
    assert all(math.isnan(value) for value in metrics.values())


def test_invalid_arguments_raise() -> None:
    with pytest.raises(ValueError, match="truncated"):
        length_bias_metrics(LENGTHS, CORRECT, SCORES)
    with pytest.raises(ValueError, match="same B"):
        length_bias_metrics(LENGTHS, CORRECT[:3], SCORES, max_response_length=64)
    with pytest.raises(ValueError, match="max_response_length"):
        length_bias_metrics(LENGTHS, CORRECT, SCORES, max_response_length=0)
