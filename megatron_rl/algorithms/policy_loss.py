"""Clipped policy-gradient losses: PPO clip (with Clip-Higher and dual clip) and GSPO.

Shape legend: B responses in the shard, T response tokens (padded).

Both losses compute a per-token clipped surrogate, optionally multiply it by
importance weights (e.g. ``importance_correction``'s TIS weights), and reduce
it with ``aggregate_loss`` under the step-wide counts. With A the advantage
and r the ratio to the old policy, the per-token loss is

    max(-A * r, -A * clip(r, 1 - clip_low, 1 + clip_high))

and, with dual clip c > 1, min(that, -A * c) where A < 0. Log-ratios are
clamped to [-20, 20] before ``exp`` so that huge differences stay finite.
Padded positions may hold anything (inf, NaN): they are replaced before any
arithmetic, so they reach neither the loss, nor a gradient, nor a metric.

Metrics (identical keys for every loss, detached 0-dim float32 tensors, means
over THIS SHARD's valid tokens; weight them by the local token count to
all-reduce):

* ``clip_frac_upper``: A > 0 and r > 1 + clip_high (upper clip active)
* ``clip_frac_lower``: A < 0 and r < 1 - clip_low (lower clip active)
* ``clip_frac_dual``:  A < 0 and the dual-clip bound active (0 without dual clip)
* ``approx_kl``: k3 estimate of KL(old || current), r - 1 - log r, per token
* ``ratio_mean``, ``ratio_max``: of the ratio the surrogate uses
"""

from __future__ import annotations

import torch

from megatron_rl.algorithms.aggregation import Count, LossAggMode, aggregate_loss
from megatron_rl.algorithms.masking import as_bool_mask, masked_fraction, masked_max, masked_mean, masked_sum
from megatron_rl.algorithms.registry import register_policy_loss

LOG_RATIO_LIMIT = 20.0


@register_policy_loss("ppo_clip")
def ppo_clip_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    clip_c: float | None = None,
    mode: LossAggMode = "token-mean",
    num_tokens: Count | None = None,
    num_seqs: Count | None = None,
    norm_constant: float | None = None,
    importance_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Token-level PPO clipped surrogate, reduced with ``aggregate_loss``.

    Args:
        log_prob: [B, T] log-probs of the sampled tokens under the current policy.
        old_log_prob: [B, T] log-probs under the policy that the ratio is taken
            against (treated as a constant).
        advantages: [B] (one per response, broadcast over its tokens) or [B, T].
        mask: [B, T], non-zero marks a valid response token.
        clip_low, clip_high: the ratio is clipped to [1 - clip_low, 1 + clip_high]
            (DAPO Clip-Higher: 0.2 / 0.28); clip_low in [0, 1], clip_high >= 0.
        clip_c: dual-clip bound for negative advantages, > 1 (DAPO recipe: 10),
            or None for no dual clip.
        mode, num_tokens, num_seqs, norm_constant: passed to ``aggregate_loss``.
        importance_weights: optional detached [B, T] factors applied to the
            per-token loss before aggregation (TIS weights).

    Returns:
        ``(loss, metrics)``: this shard's 0-dim share of the step loss, and the
        metrics listed in the module docstring.

    Raises:
        ValueError: on shape mismatches or clip parameters out of range.
    """
    _check_clip_range(clip_low, clip_high)
    if clip_c is not None and not clip_c > 1:
        raise ValueError(f"clip_c must be > 1 (or None to disable dual clip); got {clip_c!r}")
    log_prob_BT, old_log_prob_BT, valid_BT = _prepare_token_inputs(log_prob, old_log_prob, mask, importance_weights)
    advantages_BT = _advantages_per_token(advantages, log_prob_BT)

    log_ratio_BT = (log_prob_BT - old_log_prob_BT).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    ratio_BT = log_ratio_BT.exp()
    loss_BT, dual_BT = _clipped_surrogate(ratio_BT, advantages_BT, clip_low, clip_high, clip_c)
    loss = _weight_and_aggregate(loss_BT, valid_BT, importance_weights, mode, num_tokens, num_seqs, norm_constant)
    metrics = _surrogate_metrics(ratio_BT, log_ratio_BT, advantages_BT, valid_BT, clip_low, clip_high, dual_BT)
    return loss, metrics


@register_policy_loss("gspo")
def gspo_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    mode: LossAggMode = "seq-mean-token-mean",
    num_tokens: Count | None = None,
    num_seqs: Count | None = None,
    norm_constant: float | None = None,
    importance_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO (arXiv 2507.18071): PPO clip on the length-normalised sequence ratio.

    The sequence log-ratio is the mean over a response's valid tokens of
    ``log_prob - old_log_prob``, i.e. s_i = (pi / pi_old)^(1/|y_i|). Each token
    uses s_i,t = exp(sg[log s_i] + log_prob_t - sg[log_prob_t]): its value is
    s_i, its gradient is s_i * grad log_prob_t. The paper clips at about
    clip_low 3e-4, clip_high 4e-4 and averages each sequence's token mean,
    hence the default mode. Arguments, returns and errors are those of
    ``ppo_clip_loss`` (no dual clip; ``clip_frac_dual`` is 0). ``approx_kl`` is
    taken on the per-token log-ratios; the ratio metrics on s_i, per token.
    """
    _check_clip_range(clip_low, clip_high)
    log_prob_BT, old_log_prob_BT, valid_BT = _prepare_token_inputs(log_prob, old_log_prob, mask, importance_weights)
    advantages_BT = _advantages_per_token(advantages, log_prob_BT)

    token_log_ratio_BT = log_prob_BT - old_log_prob_BT
    seq_log_ratio_B = masked_sum(token_log_ratio_BT, valid_BT, dim=-1) / valid_BT.sum(dim=-1).clamp(min=1)
    seq_log_ratio_B = seq_log_ratio_B.detach().clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    ratio_BT = torch.exp(seq_log_ratio_B.unsqueeze(-1) + log_prob_BT - log_prob_BT.detach())
    loss_BT, dual_BT = _clipped_surrogate(ratio_BT, advantages_BT, clip_low, clip_high, clip_c=None)
    loss = _weight_and_aggregate(loss_BT, valid_BT, importance_weights, mode, num_tokens, num_seqs, norm_constant)
    kl_log_ratio_BT = token_log_ratio_BT.detach().clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    metrics = _surrogate_metrics(ratio_BT, kl_log_ratio_BT, advantages_BT, valid_BT, clip_low, clip_high, dual_BT)
    return loss, metrics


def _clipped_surrogate(
    ratio_BT: torch.Tensor, advantages_BT: torch.Tensor, clip_low: float, clip_high: float, clip_c: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token clipped loss [B, T] and where the dual-clip bound replaced it [B, T] bool."""
    unclipped_BT = -advantages_BT * ratio_BT
    clipped_BT = -advantages_BT * ratio_BT.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss_BT = torch.maximum(unclipped_BT, clipped_BT)
    if clip_c is None:
        return loss_BT, torch.zeros_like(loss_BT, dtype=torch.bool)
    dual_bound_BT = -advantages_BT * clip_c
    dual_BT = (advantages_BT < 0) & (loss_BT > dual_bound_BT)
    return torch.where(dual_BT, dual_bound_BT, loss_BT), dual_BT


def _weight_and_aggregate(
    loss_BT: torch.Tensor,
    valid_BT: torch.Tensor,
    importance_weights: torch.Tensor | None,
    mode: LossAggMode,
    num_tokens: Count | None,
    num_seqs: Count | None,
    norm_constant: float | None,
) -> torch.Tensor:
    if importance_weights is not None:
        weights_BT = torch.where(valid_BT, importance_weights.detach(), torch.zeros_like(loss_BT))
        loss_BT = loss_BT * weights_BT
    return aggregate_loss(
        loss_BT, valid_BT, mode, num_tokens=num_tokens, num_seqs=num_seqs, norm_constant=norm_constant
    )


@torch.no_grad()
def _surrogate_metrics(
    ratio_BT: torch.Tensor,
    log_ratio_BT: torch.Tensor,
    advantages_BT: torch.Tensor,
    valid_BT: torch.Tensor,
    clip_low: float,
    clip_high: float,
    dual_BT: torch.Tensor,
) -> dict[str, torch.Tensor]:
    upper_BT = (advantages_BT > 0) & (ratio_BT > 1.0 + clip_high)
    lower_BT = (advantages_BT < 0) & (ratio_BT < 1.0 - clip_low)
    log_ratio_f32_BT = log_ratio_BT.to(torch.float32)
    k3_BT = torch.expm1(log_ratio_f32_BT) - log_ratio_f32_BT
    ratio_f32_BT = ratio_BT.to(torch.float32)
    return {
        "clip_frac_upper": masked_fraction(upper_BT, valid_BT),
        "clip_frac_lower": masked_fraction(lower_BT, valid_BT),
        "clip_frac_dual": masked_fraction(dual_BT, valid_BT),
        "approx_kl": masked_mean(k3_BT, valid_BT),
        "ratio_mean": masked_mean(ratio_f32_BT, valid_BT),
        "ratio_max": masked_max(ratio_f32_BT, valid_BT),
    }


def _prepare_token_inputs(
    log_prob: torch.Tensor, old_log_prob: torch.Tensor, mask: torch.Tensor, importance_weights: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Check the [B, T] inputs agree in shape.

    Returns ``(log_prob, old_log_prob, valid)``: the log-probs with padded
    positions set to 0 (so garbage there cannot reach a value or a gradient),
    the old ones detached, and the bool validity mask.
    """
    if log_prob.dim() != 2:
        raise ValueError(f"log_prob must be [B, T]; got shape {tuple(log_prob.shape)}")
    if old_log_prob.shape != log_prob.shape:
        raise ValueError(f"old_log_prob must be {tuple(log_prob.shape)} like log_prob; got {tuple(old_log_prob.shape)}")
    if importance_weights is not None and importance_weights.shape != log_prob.shape:
        raise ValueError(
            f"importance_weights must be {tuple(log_prob.shape)} like log_prob; got {tuple(importance_weights.shape)}"
        )
    valid_BT = as_bool_mask(mask, log_prob)
    zero_BT = torch.zeros_like(log_prob)
    log_prob_BT = torch.where(valid_BT, log_prob, zero_BT)
    old_log_prob_BT = torch.where(valid_BT, old_log_prob.detach(), zero_BT)
    return log_prob_BT, old_log_prob_BT, valid_BT


def _advantages_per_token(advantages: torch.Tensor, log_prob_BT: torch.Tensor) -> torch.Tensor:
    """[B] or [B, T] advantages as a (broadcast) detached [B, T] tensor."""
    batch_size = log_prob_BT.shape[0]
    if advantages.shape == (batch_size,):
        return advantages.detach().unsqueeze(-1).expand_as(log_prob_BT)
    if advantages.shape == log_prob_BT.shape:
        return advantages.detach()
    raise ValueError(
        f"advantages must be [B] = ({batch_size},) or [B, T] = {tuple(log_prob_BT.shape)}; "
        f"got {tuple(advantages.shape)}"
    )


def _check_clip_range(clip_low: float, clip_high: float) -> None:
    if not 0 <= clip_low <= 1:
        raise ValueError(f"clip_low must be in [0, 1] (ratio floor 1 - clip_low); got {clip_low!r}")
    if not clip_high >= 0:
        raise ValueError(f"clip_high must be >= 0 (ratio ceiling 1 + clip_high); got {clip_high!r}")
