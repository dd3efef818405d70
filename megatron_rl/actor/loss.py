"""The actor's loss on one micro-batch, as a share of the whole optimizer step's loss.

    loss = policy_loss - entropy_coef * entropy + kl_coef * kl

Each term is reduced by ``megatron_rl.algorithms.aggregate_loss`` under the
recipe's ``loss_agg_mode`` with the STEP's token and sequence counts
(:func:`count_step`: summed over this rank's micro-batches, all-reduced over
data parallel), so summing the shares over micro-batches and DP ranks gives
the loss of the whole step and the gradient does not depend on the split.

Megatron contract: with ``calculate_per_token_loss`` the schedule sums the
returned losses and ``finalize_model_grads`` divides the gradients by the
returned token counts summed over micro-batches and DP (x CP). :func:`megatron_loss`
therefore returns ``(share * N_tok, local tokens)``: the division gives back
exactly the share's gradient (the schedule's loss function adds Megatron's third
item, the log dict). Under context parallelism every CP rank holds whole rows'
log-probs (gathered), so the loss and its metrics are computed as without CP.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_rl.actor.batch import ActorBatch
from megatron_rl.actor.token_logprobs import TokenLogProbs
from megatron_rl.algorithms import (
    aggregate_loss,
    count_tokens_and_seqs,
    get_policy_loss,
    importance_correction,
    kl_estimate,
)
from megatron_rl.config.schema import AlgorithmConfig


@dataclass(frozen=True)
class StepCounts:
    """Valid response tokens and sequences of one optimizer step, over all micro-batches and DP ranks."""

    num_tokens: torch.Tensor
    num_seqs: torch.Tensor


def count_step(micro_batches: Sequence[ActorBatch], dp_group: dist.ProcessGroup | None) -> StepCounts:
    """Sum ``count_tokens_and_seqs`` over ``micro_batches`` and all-reduce (SUM) over ``dp_group``."""
    counts = torch.zeros(2, dtype=torch.int64, device=micro_batches[0].input_ids.device)
    for micro_batch in micro_batches:
        counts += torch.stack(count_tokens_and_seqs(micro_batch.response_mask))
    if dp_group is not None and dist.get_world_size(dp_group) > 1:
        dist.all_reduce(counts, group=dp_group)
    return StepCounts(num_tokens=counts[0], num_seqs=counts[1])


def _policy_options(algorithm: AlgorithmConfig) -> dict[str, float | None]:
    options: dict[str, float | None] = {"clip_low": algorithm.clip_low, "clip_high": algorithm.clip_high}
    if algorithm.policy_loss == "ppo_clip":
        options["clip_c"] = algorithm.clip_c
    return options


def _aggregate(
    values_BS: torch.Tensor,
    micro_batch: ActorBatch,
    algorithm: AlgorithmConfig,
    counts: StepCounts,
    norm_constant: float,
) -> torch.Tensor:
    return aggregate_loss(
        values_BS,
        micro_batch.response_mask,
        algorithm.loss_agg_mode,
        num_tokens=counts.num_tokens,
        num_seqs=counts.num_seqs,
        norm_constant=norm_constant,
    )


def actor_loss(
    current: TokenLogProbs,
    micro_batch: ActorBatch,
    counts: StepCounts,
    algorithm: AlgorithmConfig,
    norm_constant: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """This micro-batch's share of the step loss.

    Returns ``(loss, shares, means)``: the 0-dim loss; the detached loss
    terms (``policy_loss``, ``entropy_loss``, ``kl_loss``, each a share of
    the step value); and token-mean metrics over this micro-batch (clip
    fractions, approx KL, entropy, ratio, rollout mismatch, KL to reference).

    Raises:
        ValueError: the batch lacks old log-probs or advantages, or ref
            log-probs while the KL loss is on.
    """
    old_log_probs, advantages = micro_batch.old_log_probs, micro_batch.advantages
    if old_log_probs is None or advantages is None:
        raise ValueError("training needs batch.old_log_probs (PolicyActor.log_probs) and batch.advantages")
    mask_BS = micro_batch.response_mask
    weights_BS: torch.Tensor | None = None
    means: dict[str, torch.Tensor] = {}
    if micro_batch.rollout_log_probs is not None:
        weights_BS, means = importance_correction(
            old_log_probs, micro_batch.rollout_log_probs, mask_BS, algorithm.tis_cap
        )
        weights_BS = weights_BS if algorithm.tis_cap is not None else None
    policy_loss, policy_metrics = get_policy_loss(algorithm.policy_loss)(
        current.log_probs,
        old_log_probs,
        advantages,
        mask_BS,
        mode=algorithm.loss_agg_mode,
        num_tokens=counts.num_tokens,
        num_seqs=counts.num_seqs,
        norm_constant=norm_constant,
        importance_weights=weights_BS,
        **_policy_options(algorithm),
    )
    entropy_loss = _aggregate(current.entropy, micro_batch, algorithm, counts, norm_constant)
    loss = policy_loss - algorithm.entropy_coef * entropy_loss
    shares = {"policy_loss": policy_loss.detach(), "entropy_loss": entropy_loss.detach()}
    means |= policy_metrics | {"entropy": _token_mean(current.entropy, mask_BS)}
    if algorithm.use_kl_loss:
        kl_loss, kl_mean = _kl_terms(current.log_probs, micro_batch, counts, algorithm, norm_constant)
        loss = loss + algorithm.kl_coef * kl_loss
        shares["kl_loss"], means["kl_ref"] = kl_loss.detach(), kl_mean
    shares["loss"] = loss.detach()
    return loss, shares, means


def _kl_terms(
    log_probs_BS: torch.Tensor,
    micro_batch: ActorBatch,
    counts: StepCounts,
    algorithm: AlgorithmConfig,
    norm_constant: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    if micro_batch.ref_log_probs is None:
        raise ValueError(
            "algorithm.use_kl_loss is on but the batch has no ref_log_probs (PolicyActor.log_probs(reference=True))"
        )
    kl_BS = kl_estimate(log_probs_BS, micro_batch.ref_log_probs, algorithm.kl_type)
    return _aggregate(kl_BS, micro_batch, algorithm, counts, norm_constant), _token_mean(
        kl_BS, micro_batch.response_mask
    )


@torch.no_grad()
def _token_mean(values_BS: torch.Tensor, mask_BS: torch.Tensor) -> torch.Tensor:
    selected = torch.where(mask_BS, values_BS.float(), torch.zeros_like(values_BS, dtype=torch.float32))
    return selected.sum() / mask_BS.sum().clamp(min=1)


def megatron_loss(
    loss: torch.Tensor, micro_batch: ActorBatch, counts: StepCounts, cp_group: dist.ProcessGroup | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss * N_tok, local token count)`` for Megatron's per-token-loss path (see the module docstring).

    With context parallelism every CP rank computes the whole rows' loss, and its backward reaches
    the model through this rank's positions only. Megatron only uses the token counts summed over
    DP x CP, so CP rank 0 counts the micro-batch's tokens and the other CP ranks 0.
    """
    tokens = micro_batch.response_mask.sum().to(torch.int)
    if cp_group is not None and cp_group.rank() > 0:
        tokens = torch.zeros_like(tokens)
    return loss * counts.num_tokens.clamp(min=1).to(loss.dtype), tokens
