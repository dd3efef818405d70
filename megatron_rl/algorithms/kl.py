"""Per-token estimators of KL(current || reference) from sampled tokens.

Shape legend: B responses, T response tokens (padded).

With d = log_prob - ref_log_prob on tokens sampled from the current policy
(Schulman's estimators, http://joschu.net/blog/kl-approx.html):

* ``k1``: d                                  unbiased, high variance, can be < 0
* ``k2``: 0.5 * d^2                          biased, low variance, >= 0
* ``k3`` (alias ``low_var_kl``): exp(-d) + d - 1, unbiased, >= 0; clamped to
  [-10, 10] (the exponent first to [-20, 20]) so that a far-off token cannot
  blow the loss up; the gradient is zero where the clamp is active.

Reduce the result with ``aggregate_loss`` to use it as a loss term.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, get_args

import torch

KLKind = Literal["k1", "k2", "k3", "low_var_kl"]
KL_KINDS: tuple[str, ...] = get_args(KLKind)

K3_LIMIT = 10.0
LOG_RATIO_LIMIT = 20.0


def _k1(diff_BT: torch.Tensor) -> torch.Tensor:
    return diff_BT


def _k2(diff_BT: torch.Tensor) -> torch.Tensor:
    return 0.5 * diff_BT.square()


def _k3(diff_BT: torch.Tensor) -> torch.Tensor:
    ref_minus_cur_BT = (-diff_BT).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    k3_BT = torch.expm1(ref_minus_cur_BT) - ref_minus_cur_BT
    return k3_BT.clamp(-K3_LIMIT, K3_LIMIT)


_ESTIMATORS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "k1": _k1,
    "k2": _k2,
    "k3": _k3,
    "low_var_kl": _k3,
}


def kl_estimate(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kind: KLKind) -> torch.Tensor:
    """Per-token KL estimate of kind ``kind``, same shape as the inputs (usually [B, T]).

    Args:
        log_prob: log-probs of the sampled tokens under the current policy.
        ref_log_prob: log-probs of the same tokens under the reference policy
            (treated as a constant).
        kind: one of ``KL_KINDS``.

    Raises:
        ValueError: unknown ``kind`` (the message lists the kinds) or shapes that differ.
    """
    if kind not in _ESTIMATORS:
        raise ValueError(f"kind must be one of {KL_KINDS}; got {kind!r}")
    if log_prob.shape != ref_log_prob.shape:
        raise ValueError(
            f"log_prob and ref_log_prob must have the same shape; "
            f"got {tuple(log_prob.shape)} and {tuple(ref_log_prob.shape)}"
        )
    return _ESTIMATORS[kind](log_prob - ref_log_prob.detach())
