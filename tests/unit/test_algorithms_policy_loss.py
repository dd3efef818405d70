"""PPO clip (Clip-Higher, dual clip) and GSPO: hand-computed losses, gradients, metrics, edge cases."""

import math

import pytest
import torch

from megatron_rl.algorithms import PolicyLoss, gspo_loss, importance_correction, ppo_clip_loss

CLIP = {"clip_low": 0.2, "clip_high": 0.28}
# (advantage, ratio) per token; row 1 ends with padding.
#   A=+1 r=1.5 -> upper clip:  max(-1.5, -1.28) = -1.28
#   A=+1 r=0.5 -> unclipped:   max(-0.5, -0.8)  = -0.5
#   A=-1 r=0.5 -> lower clip:  max(0.5, 0.8)    =  0.8
#   A=-1 r=1.5 -> unclipped:   max(1.5, 1.28)   =  1.5
#   A=-2 r=4.0 -> max(8, 2.56) = 8, dual clip c=3: min(8, 6) = 6
ADVANTAGES = torch.tensor([[1.0, 1.0, -1.0], [-1.0, -2.0, 0.0]])
RATIOS = torch.tensor([[1.5, 0.5, 0.5], [1.5, 4.0, 1.0]])
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
OLD = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, -1.5, -2.0]])


def current_log_prob() -> torch.Tensor:
    return (OLD + RATIOS.log()).requires_grad_()


def test_ppo_clip_loss_matches_hand_computed_token_losses() -> None:
    loss, _ = ppo_clip_loss(current_log_prob(), OLD, ADVANTAGES, MASK, **CLIP)
    assert loss.item() == pytest.approx((-1.28 - 0.5 + 0.8 + 1.5 + 8.0) / 5)


def test_dual_clip_bounds_negative_advantages() -> None:
    loss, metrics = ppo_clip_loss(current_log_prob(), OLD, ADVANTAGES, MASK, clip_c=3.0, **CLIP)
    assert loss.item() == pytest.approx((-1.28 - 0.5 + 0.8 + 1.5 + 6.0) / 5)
    assert metrics["clip_frac_dual"].item() == pytest.approx(1 / 5)


@pytest.mark.parametrize("log_ratio", [-30.0, -1.0, 0.0, 1.0, 3.0, 30.0, 1e4])
def test_dual_clip_caps_loss_of_negative_advantage_at_c_times_abs_advantage(log_ratio: float) -> None:
    log_prob = torch.tensor([[log_ratio]], requires_grad=True)
    loss, _ = ppo_clip_loss(log_prob, torch.zeros(1, 1), torch.tensor([-2.0]), torch.ones(1, 1), clip_c=3.0, **CLIP)
    assert loss.item() <= 2.0 * 3.0 + 1e-6
    assert loss.item() == pytest.approx(2.0 * min(max(math.exp(min(log_ratio, 20.0)), 0.8), 3.0), rel=1e-5)


def test_clip_fractions_and_metrics_on_hand_built_case() -> None:
    _, metrics = ppo_clip_loss(current_log_prob(), OLD, ADVANTAGES, MASK, **CLIP)
    assert metrics["clip_frac_upper"].item() == pytest.approx(1 / 5)
    assert metrics["clip_frac_lower"].item() == pytest.approx(1 / 5)
    assert metrics["clip_frac_dual"].item() == 0.0
    assert metrics["ratio_mean"].item() == pytest.approx((1.5 + 0.5 + 0.5 + 1.5 + 4.0) / 5)
    assert metrics["ratio_max"].item() == pytest.approx(4.0)
    # k3 = r - 1 - ln r: 0.0945349 for 1.5, 0.1931472 for 0.5, 1.6137056 for 4
    assert metrics["approx_kl"].item() == pytest.approx((2 * 0.0945349 + 2 * 0.1931472 + 1.6137056) / 5, rel=1e-5)


def test_clipped_tokens_get_zero_gradient_and_unclipped_ones_minus_advantage_times_ratio() -> None:
    log_prob = current_log_prob()
    loss, _ = ppo_clip_loss(log_prob, OLD, ADVANTAGES, MASK, clip_c=3.0, **CLIP)
    loss.backward()
    # d(-A r)/d logp = -A r, over 5 tokens; upper, lower and dual clipped tokens are constant.
    expected = torch.tensor([[0.0, -0.5 / 5, 0.0], [1.5 / 5, 0.0, 0.0]])
    torch.testing.assert_close(log_prob.grad, expected)


def test_per_response_advantages_broadcast_like_per_token_ones() -> None:
    per_response = torch.tensor([1.0, -1.0])
    per_token = per_response.unsqueeze(-1).expand(2, 3)
    by_response, _ = ppo_clip_loss(current_log_prob(), OLD, per_response, MASK, **CLIP)
    by_token, _ = ppo_clip_loss(current_log_prob(), OLD, per_token, MASK, **CLIP)
    torch.testing.assert_close(by_response, by_token)


def test_huge_log_ratio_is_clamped_to_finite_loss_and_gradient() -> None:
    log_prob = torch.tensor([[1e4, -1e4], [1e4, 0.0]], requires_grad=True)
    loss, metrics = ppo_clip_loss(log_prob, torch.zeros(2, 2), torch.tensor([1.0, -1.0]), torch.ones(2, 2), **CLIP)
    loss.backward()
    assert torch.isfinite(loss)
    assert log_prob.grad is not None and torch.isfinite(log_prob.grad).all()
    assert all(torch.isfinite(value) for value in metrics.values())
    assert metrics["ratio_max"].item() == pytest.approx(math.exp(20.0), rel=1e-5)


@pytest.mark.parametrize("loss_fn", [ppo_clip_loss, gspo_loss])
def test_garbage_log_probs_in_padding_reach_neither_loss_gradient_nor_metrics(loss_fn: PolicyLoss) -> None:
    clean = current_log_prob()
    dirty = current_log_prob().detach().clone()
    dirty[1, 2] = float("nan")
    dirty.requires_grad_()
    dirty_old = OLD.clone()
    dirty_old[1, 2] = -float("inf")
    clean_loss, clean_metrics = loss_fn(clean, OLD, ADVANTAGES, MASK, **CLIP)
    dirty_loss, dirty_metrics = loss_fn(dirty, dirty_old, ADVANTAGES, MASK, **CLIP)
    clean_loss.backward()
    dirty_loss.backward()
    torch.testing.assert_close(dirty_loss, clean_loss)
    torch.testing.assert_close(dirty.grad, clean.grad)
    torch.testing.assert_close(dirty_metrics, clean_metrics)


def test_importance_weights_scale_each_token_loss() -> None:
    weights = torch.tensor([[2.0, 1.0, 0.5], [1.0, 0.0, 9.0]])
    loss, _ = ppo_clip_loss(current_log_prob(), OLD, ADVANTAGES, MASK, importance_weights=weights, **CLIP)
    assert loss.item() == pytest.approx((2 * -1.28 - 0.5 + 0.5 * 0.8 + 1.5 + 0 * 8.0) / 5)


def test_tis_weights_from_importance_correction_plug_into_the_loss() -> None:
    rollout = OLD - torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]])  # token (0, 1): exp(1) capped to 2
    weights, _ = importance_correction(OLD, rollout, MASK, cap=2.0)
    loss, _ = ppo_clip_loss(current_log_prob(), OLD, ADVANTAGES, MASK, importance_weights=weights, **CLIP)
    assert loss.item() == pytest.approx((-1.28 - 2 * 0.5 + 0.8 + 1.5 + 8.0) / 5)


def test_metrics_are_detached_0dim_tensors_with_the_same_keys_for_every_loss() -> None:
    _, ppo_metrics = ppo_clip_loss(current_log_prob(), OLD, ADVANTAGES, MASK, **CLIP)
    _, gspo_metrics = gspo_loss(current_log_prob(), OLD, ADVANTAGES, MASK, **CLIP)
    assert ppo_metrics.keys() == gspo_metrics.keys()
    for value in [*ppo_metrics.values(), *gspo_metrics.values()]:
        assert value.dim() == 0 and not value.requires_grad and value.dtype == torch.float32


def test_no_valid_token_gives_zero_loss_and_zero_metrics() -> None:
    log_prob = current_log_prob()
    loss, metrics = ppo_clip_loss(log_prob, OLD, ADVANTAGES, torch.zeros(2, 3), **CLIP)
    loss.backward()
    assert loss.item() == 0.0
    assert log_prob.grad is not None and torch.equal(log_prob.grad, torch.zeros(2, 3))
    assert all(value.item() == 0.0 for value in metrics.values())


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"clip_c": 1.0}, "clip_c"),
        ({"clip_c": 0.5}, "clip_c"),
        ({"clip_low": -0.1}, "clip_low"),
        ({"clip_low": 1.5}, "clip_low"),
        ({"clip_high": -0.2}, "clip_high"),
        ({"advantages": torch.zeros(3)}, "advantages"),
        ({"old_log_prob": torch.zeros(2, 4)}, "old_log_prob"),
        ({"mask": torch.ones(2, 4)}, "mask"),
        ({"importance_weights": torch.ones(3)}, "importance_weights"),
    ],
)
def test_ppo_clip_invalid_arguments_raise_naming_them(overrides: dict, message: str) -> None:
    arguments = {"log_prob": current_log_prob(), "old_log_prob": OLD, "advantages": ADVANTAGES, "mask": MASK}
    arguments |= CLIP | overrides
    with pytest.raises(ValueError, match=message):
        ppo_clip_loss(**arguments)


# GSPO: row 0 has token log-ratios 0.1 and 0.3 (sequence log-ratio 0.2), row 1 has -0.3 and padding.
GSPO_OLD = torch.tensor([[-1.0, -2.0], [-0.7, -5.0]])
GSPO_LOG_RATIO = torch.tensor([[0.1, 0.3], [-0.3, 0.0]])
GSPO_MASK = torch.tensor([[1, 1], [1, 0]])
GSPO_ADVANTAGES = torch.tensor([1.0, -1.0])
S0, S1 = math.exp(0.2), math.exp(-0.3)  # 1.2214028, 0.7408182


def gspo_log_prob() -> torch.Tensor:
    return (GSPO_OLD + GSPO_LOG_RATIO).requires_grad_()


def test_gspo_clips_the_length_normalised_sequence_ratio() -> None:
    loss, metrics = gspo_loss(gspo_log_prob(), GSPO_OLD, GSPO_ADVANTAGES, GSPO_MASK, clip_low=3e-4, clip_high=4e-4)
    # row 0: A=+1, s=1.2214 > 1.0004 -> -1.0004 per token; row 1: A=-1, s=0.7408 < 0.9997 -> 0.9997
    assert loss.item() == pytest.approx((-1.0004 + 0.9997) / 2, abs=1e-7)
    assert metrics["clip_frac_upper"].item() == pytest.approx(2 / 3)
    assert metrics["clip_frac_lower"].item() == pytest.approx(1 / 3)
    assert metrics["ratio_mean"].item() == pytest.approx((2 * S0 + S1) / 3)


def test_gspo_token_gradient_is_sequence_ratio_times_token_score_gradient() -> None:
    log_prob = gspo_log_prob()
    loss, _ = gspo_loss(log_prob, GSPO_OLD, GSPO_ADVANTAGES, GSPO_MASK, clip_low=0.9, clip_high=10.0)
    loss.backward()
    assert loss.item() == pytest.approx((-S0 + S1) / 2)
    # d/d logp_t of mean_seq[-A s] = -A * s / |y| / num_seqs
    expected = torch.tensor([[-S0 / 2 / 2, -S0 / 2 / 2], [S1 / 1 / 2, 0.0]])
    torch.testing.assert_close(log_prob.grad, expected)


def test_gspo_invalid_clip_range_raises() -> None:
    with pytest.raises(ValueError, match="clip_high"):
        gspo_loss(gspo_log_prob(), GSPO_OLD, GSPO_ADVANTAGES, GSPO_MASK, clip_low=3e-4, clip_high=-4e-4)
