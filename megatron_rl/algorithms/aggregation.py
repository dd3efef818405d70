"""Reduce a per-token loss to the scalar that is back-propagated.

Every mode is defined over the WHOLE optimizer step: all micro-batches of all
data-parallel ranks. A shard (one micro-batch on one rank) returns its share,
computed with the step's global counts, so that summing the shards' results
gives the whole-batch loss and the gradient does not depend on how the batch
was split. Callers get the global counts by summing ``count_tokens_and_seqs``
over their micro-batches and all-reducing (SUM) over data-parallel ranks.

Shape legend: B responses in the shard, T response tokens (padded).

Modes (l = per-token loss, m = mask, N_tok / N_seq = step-wide counts, C = norm_constant):

* ``token-mean``:              sum_{i,t} l*m / N_tok                      (DAPO token-level loss)
* ``seq-mean-token-mean``:     sum_i [sum_t l*m / sum_t m] / N_seq        (original GRPO)
* ``seq-mean-token-sum``:      sum_i [sum_t l*m] / N_seq
* ``seq-mean-token-sum-norm``: sum_i [sum_t l*m / C] / N_seq              (Dr.GRPO, C = generation budget)

A sequence counts towards N_seq only if it has at least one valid token:
fully masked rows (padding rows added to even out micro-batches) contribute
nothing to the numerator and are not counted. Sequences are whole rows; a row
is never split between shards.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch

from megatron_rl.algorithms.masking import as_bool_mask, masked_sum

LossAggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
LOSS_AGG_MODES: tuple[str, ...] = get_args(LossAggMode)

Count = int | float | torch.Tensor


def count_tokens_and_seqs(mask_BT: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Local ``(num_tokens, num_seqs)`` of a shard, as 0-dim int64 tensors.

    ``num_tokens`` is the number of valid tokens; ``num_seqs`` the number of
    rows with at least one valid token (the same rule ``aggregate_loss`` uses
    by default). Sum them over micro-batches and all-reduce over data-parallel
    ranks to get the step-wide counts ``aggregate_loss`` expects.
    """
    valid_BT = mask_BT != 0
    return valid_BT.sum(), valid_BT.any(dim=-1).sum()


def aggregate_loss(
    loss: torch.Tensor,
    mask: torch.Tensor,
    mode: LossAggMode,
    *,
    num_tokens: Count | None = None,
    num_seqs: Count | None = None,
    norm_constant: float | None = None,
) -> torch.Tensor:
    """This shard's share of the step loss (0-dim), under ``mode``.

    Args:
        loss: per-token loss [B, T]. Values at masked positions are ignored,
            even if they are inf or NaN.
        mask: [B, T], non-zero marks a valid response token.
        mode: one of ``LOSS_AGG_MODES`` (see the module docstring).
        num_tokens: valid tokens in the whole step (``token-mean`` only).
            Defaults to this shard's count, i.e. a local mean.
        num_seqs: sequences with at least one valid token in the whole step
            (the ``seq-mean-*`` modes). Defaults to this shard's count.
        norm_constant: C of ``seq-mean-token-sum-norm``, in tokens (Dr.GRPO uses
            the max response length); required by that mode, ignored by others.

    Returns:
        A 0-dim tensor. With no valid token it is 0 and still part of the
        autograd graph (its gradient is zero, never NaN); a zero count is
        treated as one for the same reason.

    Raises:
        ValueError: unknown ``mode``; ``loss`` not 2-D or ``mask`` of another
            shape; missing or non-positive ``norm_constant`` for
            ``seq-mean-token-sum-norm``; a negative count.
    """
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"mode must be one of {LOSS_AGG_MODES}; got {mode!r}")
    if loss.dim() != 2:
        raise ValueError(f"loss must be [B, T]; got shape {tuple(loss.shape)}")
    valid_BT = as_bool_mask(mask, loss)

    if mode == "token-mean":
        return masked_sum(loss, valid_BT) / _denominator(num_tokens, valid_BT.sum(), "num_tokens")

    token_sum_B = masked_sum(loss, valid_BT, dim=-1)
    if mode == "seq-mean-token-mean":
        per_seq_B = token_sum_B / valid_BT.sum(dim=-1).clamp(min=1)
    elif mode == "seq-mean-token-sum":
        per_seq_B = token_sum_B
    else:
        per_seq_B = token_sum_B / _check_norm_constant(norm_constant)
    return per_seq_B.sum() / _denominator(num_seqs, valid_BT.any(dim=-1).sum(), "num_seqs")


def _check_norm_constant(norm_constant: float | None) -> float:
    if norm_constant is None or norm_constant <= 0:
        raise ValueError(
            "norm_constant must be a positive number of tokens (e.g. the max response length) "
            f"for mode 'seq-mean-token-sum-norm'; got {norm_constant!r}"
        )
    return norm_constant


def _denominator(count: Count | None, local_count: torch.Tensor, name: str) -> Count:
    """``count`` (or the local count) clamped to at least 1."""
    if count is None:
        return local_count.clamp(min=1)
    if isinstance(count, torch.Tensor):
        return count.clamp(min=1)
    if count < 0:
        raise ValueError(f"{name} must be >= 0; got {count!r}")
    return max(count, 1)
