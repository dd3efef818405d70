"""Truncated importance sampling weights and rollout/trainer mismatch metrics."""

import math

import pytest
import torch

from megatron_rl.algorithms import importance_correction

OLD = torch.tensor([[0.0, -1.0, -2.0], [-0.5, -3.0, -4.0]])
ROLLOUT = torch.tensor([[0.0, -1.5, -1.0], [-0.5, -1.0, float("nan")]])
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
# d = old - rollout on valid tokens: [0, 0.5, -1], [0, -2]


def test_tis_weights_are_capped_ratio_on_valid_tokens_and_zero_on_padding() -> None:
    weights, _ = importance_correction(OLD, ROLLOUT, MASK, cap=1.5)
    expected = torch.tensor([[1.0, 1.5, math.exp(-1)], [1.0, math.exp(-2), 0.0]])
    torch.testing.assert_close(weights, expected)


def test_tis_metrics_match_hand_computed_values() -> None:
    _, metrics = importance_correction(OLD, ROLLOUT, MASK, cap=1.5)
    assert metrics["mismatch_abs_mean"].item() == pytest.approx((0 + 0.5 + 1 + 0 + 2) / 5)
    assert metrics["mismatch_abs_max"].item() == pytest.approx(2.0)
    # exp(d) - 1 - d: 0, 0.1487213, 0.3678794, 0, 1.1353353
    assert metrics["mismatch_kl"].item() == pytest.approx((0.1487213 + 0.3678794 + 1.1353353) / 5, rel=1e-5)
    assert metrics["tis_capped_frac"].item() == pytest.approx(1 / 5)
    assert metrics["tis_weight_mean"].item() == pytest.approx((1 + 1.5 + math.exp(-1) + 1 + math.exp(-2)) / 5)


def test_without_cap_weights_are_one_and_mismatch_is_still_measured() -> None:
    weights, metrics = importance_correction(OLD, ROLLOUT, MASK, cap=None)
    torch.testing.assert_close(weights, MASK.float())
    assert metrics["tis_capped_frac"].item() == 0.0
    assert metrics["tis_weight_mean"].item() == 1.0
    assert metrics["mismatch_abs_max"].item() == pytest.approx(2.0)


def test_huge_mismatch_is_clamped_to_finite_weights_and_metrics() -> None:
    old = torch.tensor([[100.0, -100.0]])
    _, metrics = importance_correction(old, torch.zeros(1, 2), torch.ones(1, 2), cap=None)
    assert all(torch.isfinite(value) for value in metrics.values())
    capped, _ = importance_correction(old, torch.zeros(1, 2), torch.ones(1, 2), cap=2.0)
    torch.testing.assert_close(capped, torch.tensor([[2.0, math.exp(-20.0)]]))


def test_weights_and_metrics_are_detached() -> None:
    old = OLD.clone().requires_grad_()
    weights, metrics = importance_correction(old, ROLLOUT, MASK, cap=2.0)
    assert not weights.requires_grad
    assert not any(value.requires_grad for value in metrics.values())


@pytest.mark.parametrize("cap", [0.0, -1.0])
def test_non_positive_cap_raises(cap: float) -> None:
    with pytest.raises(ValueError, match="cap"):
        importance_correction(OLD, ROLLOUT, MASK, cap=cap)


def test_shape_mismatch_raises() -> None:
    with pytest.raises(ValueError, match="rollout_log_prob"):
        importance_correction(OLD, ROLLOUT[:, :2], MASK, cap=2.0)
