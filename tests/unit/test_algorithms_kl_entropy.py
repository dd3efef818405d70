"""KL estimators (k1, k2, k3 / low_var_kl with clamp) and entropy from logits."""

import math

import pytest
import torch

from megatron_rl.algorithms import KL_KINDS, KLKind, entropy_from_logits, kl_estimate

LOG_PROB = torch.tensor([[0.0, -1.0, -2.0]])
REF_LOG_PROB = torch.tensor([[-1.0, 0.0, -2.0]])  # log_prob - ref = [1, -1, 0]


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        ("k1", [1.0, -1.0, 0.0]),
        ("k2", [0.5, 0.5, 0.0]),
        # exp(ref - logp) - (ref - logp) - 1 with ref - logp = [-1, 1, 0]
        ("k3", [math.exp(-1) + 1 - 1, math.exp(1) - 1 - 1, 0.0]),
        ("low_var_kl", [0.3678794, 0.7182818, 0.0]),
    ],
)
def test_kl_kinds_match_hand_computed_values(kind: KLKind, expected: list[float]) -> None:
    torch.testing.assert_close(kl_estimate(LOG_PROB, REF_LOG_PROB, kind), torch.tensor([expected]))


def test_k3_is_clamped_to_ten_with_finite_zero_gradient() -> None:
    log_prob = torch.tensor([0.0, 0.0, -3.0], requires_grad=True)
    ref_log_prob = torch.tensor([-50.0, 50.0, -3.0])
    k3 = kl_estimate(log_prob, ref_log_prob, "k3")
    k3.sum().backward()
    assert k3.tolist() == [10.0, 10.0, 0.0]
    assert log_prob.grad is not None and log_prob.grad.tolist() == [0.0, 0.0, 0.0]


def test_kl_estimate_does_not_differentiate_the_reference() -> None:
    log_prob = torch.tensor([0.0], requires_grad=True)
    ref_log_prob = torch.tensor([0.5], requires_grad=True)
    kl_estimate(log_prob, ref_log_prob, "k2").sum().backward()
    assert log_prob.grad is not None and log_prob.grad.item() == pytest.approx(-0.5)
    assert ref_log_prob.grad is None


def test_unknown_kl_kind_raises_listing_kinds() -> None:
    assert set(KL_KINDS) == {"k1", "k2", "k3", "low_var_kl"}
    with pytest.raises(ValueError, match="low_var_kl"):
        kl_estimate(LOG_PROB, REF_LOG_PROB, "mse")  # type: ignore[arg-type]  # not a kind, on purpose


def test_kl_shape_mismatch_raises() -> None:
    with pytest.raises(ValueError, match="shape"):
        kl_estimate(LOG_PROB, REF_LOG_PROB[:, :2], "k1")


def test_entropy_matches_manual_softmax_computation() -> None:
    logits = torch.randn(2, 3, 11, generator=torch.Generator().manual_seed(0)) * 3
    probs = logits.double().softmax(dim=-1)
    expected = -(probs * probs.log()).sum(dim=-1)
    torch.testing.assert_close(entropy_from_logits(logits), expected.float())


def test_entropy_of_uniform_distribution_is_log_vocab_size() -> None:
    entropy = entropy_from_logits(torch.full((4, 7), 3.5))
    torch.testing.assert_close(entropy, torch.full((4,), math.log(7)))


def test_entropy_matches_hand_computed_value() -> None:
    # p = (1/2, 1/4, 1/4): H = 0.5 ln 2 + 0.5 ln 4 = 1.5 ln 2
    entropy = entropy_from_logits(torch.tensor([0.5, 0.25, 0.25]).log())
    assert entropy.item() == pytest.approx(1.5 * math.log(2))


def test_entropy_of_bf16_logits_is_computed_in_float32() -> None:
    logits = (torch.randn(5, 32, generator=torch.Generator().manual_seed(1)) * 4).to(torch.bfloat16)
    entropy = entropy_from_logits(logits)
    assert entropy.dtype == torch.float32
    torch.testing.assert_close(entropy, entropy_from_logits(logits.float()))


def test_entropy_is_stable_for_huge_and_masked_logits() -> None:
    logits = torch.tensor([[1e4, 0.0, 0.0], [0.0, 0.0, -float("inf")]], requires_grad=True)
    entropy = entropy_from_logits(logits)
    entropy.sum().backward()
    torch.testing.assert_close(entropy.detach(), torch.tensor([0.0, math.log(2)]))
    assert logits.grad is not None and torch.isfinite(logits.grad).all()


def test_entropy_rejects_0dim_logits() -> None:
    with pytest.raises(ValueError, match="logits"):
        entropy_from_logits(torch.tensor(1.0))
