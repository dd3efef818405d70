"""Rollout/trainer mismatch: measurement and truncated importance sampling (TIS).

Shape legend: B responses, T response tokens (padded).

The engine that sampled a response and the trainer that recomputes its
log-probs disagree slightly (kernels, precision, MoE routing). With
d = old_log_prob (trainer) - rollout_log_prob (engine), TIS (Yao et al., 2025)
multiplies the per-token policy loss by min(exp(d), cap); pass the weights as
the policy loss's ``importance_weights``. The mismatch is measured whether or
not the weights are used.

Metrics (detached 0-dim float32 tensors, over THIS SHARD's valid tokens):

* ``mismatch_abs_mean``, ``mismatch_abs_max``: mean and max of |d|
* ``mismatch_kl``: k3 estimate of KL(rollout || trainer), exp(d) - 1 - d, token mean
* ``tis_capped_frac``: fraction of tokens where exp(d) > cap (0 without a cap)
* ``tis_weight_mean``: mean of the weights on valid tokens
"""

from __future__ import annotations

import torch

from megatron_rl.algorithms.masking import as_bool_mask, masked_fraction, masked_max, masked_mean

LOG_RATIO_LIMIT = 20.0


@torch.no_grad()
def importance_correction(
    old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, mask: torch.Tensor, cap: float | None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """TIS weights [B, T] and mismatch metrics.

    Args:
        old_log_prob: [B, T] log-probs recomputed by the trainer.
        rollout_log_prob: [B, T] log-probs reported by the rollout engine.
        mask: [B, T], non-zero marks a valid response token.
        cap: C > 0 (about 2 in the TIS paper), or None for no correction.

    Returns:
        ``(weights, metrics)``. ``weights`` is detached float32:
        min(exp(clamp(d, -20, 20)), cap) on valid tokens (1 there when ``cap``
        is None) and 0 on padding, so padding stays inert whatever multiplies it.

    Raises:
        ValueError: shapes that differ, or ``cap`` not > 0.
    """
    if cap is not None and not cap > 0:
        raise ValueError(f"cap must be > 0 (or None for no correction); got {cap!r}")
    if rollout_log_prob.shape != old_log_prob.shape:
        raise ValueError(
            f"rollout_log_prob must be {tuple(old_log_prob.shape)} like old_log_prob; "
            f"got {tuple(rollout_log_prob.shape)}"
        )
    valid_BT = as_bool_mask(mask, old_log_prob)
    zero_BT = torch.zeros_like(old_log_prob, dtype=torch.float32)
    diff_BT = torch.where(valid_BT, old_log_prob.float() - rollout_log_prob.float(), zero_BT)
    log_ratio_BT = diff_BT.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    ratio_BT = log_ratio_BT.exp()

    if cap is None:
        weights_BT = valid_BT.to(torch.float32)
        capped_BT = torch.zeros_like(valid_BT)
    else:
        weights_BT = torch.where(valid_BT, ratio_BT.clamp(max=cap), zero_BT)
        capped_BT = ratio_BT > cap
    metrics = {
        "mismatch_abs_mean": masked_mean(diff_BT.abs(), valid_BT),
        "mismatch_abs_max": masked_max(diff_BT.abs(), valid_BT),
        "mismatch_kl": masked_mean(torch.expm1(log_ratio_BT) - log_ratio_BT, valid_BT),
        "tis_capped_frac": masked_fraction(capped_BT, valid_BT),
        "tis_weight_mean": masked_mean(weights_BT, valid_BT),
    }
    return weights_BT, metrics
