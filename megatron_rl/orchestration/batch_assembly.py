"""From a step's rollout groups to what the actor trains on, and the step's rollout metrics.

Shape legend: B responses (all samples of all groups, group by group), S the
longest prompt + response, L decoder layers, K experts per token.

Alignment follows :class:`megatron_rl.actor.ActorBatch`: row b holds
``prompt_ids + response_ids`` right padded; the engine's log-prob of response
token j sits at position ``len(prompt) + j`` (log p of that token given what
precedes it); ``routed_experts`` of position t routes token t (the engine
reports positions ``0 .. len(prompt) + len(response) - 2``; the rest is 0).
"""

from __future__ import annotations

import torch

from megatron_rl.actor import ActorBatch
from megatron_rl.algorithms import get_advantage_estimator, length_bias_metrics
from megatron_rl.rollout.groups import RolloutGroup, RolloutSample


def _samples(groups: list[RolloutGroup]) -> list[RolloutSample]:
    if not groups or any(not g.samples for g in groups):
        raise ValueError("a training step needs at least one group, each with at least one sample")
    return [sample for group in groups for sample in group.samples]


def group_advantages(groups: list[RolloutGroup], *, estimator: str = "grpo", norm_by_std: bool) -> torch.Tensor:
    """[B] advantages of every sample by the registered ``estimator`` (``grpo``: Dr.GRPO when ``norm_by_std``
    is False), groups told apart by uid."""
    samples = _samples(groups)
    uids = [group.uid for group in groups for _ in group.samples]
    scores = torch.tensor([s.score for s in samples], dtype=torch.float32)
    return get_advantage_estimator(estimator)(scores, uids, norm_by_std)


def trim_to_even_split(groups: list[RolloutGroup], unit: int) -> list[RolloutGroup]:
    """The longest prefix of ``groups`` whose response count is a multiple of ``unit`` (possibly empty).

    ``unit`` is mini-batches x data-parallel ranks: every mini-batch must split evenly over the
    ranks. A full step always splits (a recipe check); a partial one (dynamic sampling's
    ``on_exhausted: train_partial``) is trimmed here.
    """
    total, keep = 0, 0
    for count, group in enumerate(groups, start=1):
        total += len(group.samples)
        if total % unit == 0:
            keep = count
    return groups[:keep]


def assemble_actor_batch(groups: list[RolloutGroup], advantages: torch.Tensor, *, pad_token_id: int = 0) -> ActorBatch:
    """The actor's batch of ``groups``: token ids, loss mask, [B] advantages, rollout log-probs, routed experts.

    ``routed_experts`` is set only when every sample carries them. Raises ValueError when
    ``advantages`` does not have one value per sample.
    """
    samples = _samples(groups)
    if tuple(advantages.shape) != (len(samples),):
        raise ValueError(f"advantages must be [B] = ({len(samples)},); got {tuple(advantages.shape)}")
    seq = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    input_ids = torch.full((len(samples), seq), pad_token_id, dtype=torch.long)
    response_mask = torch.zeros(len(samples), seq, dtype=torch.bool)
    rollout_log_probs = torch.zeros(len(samples), seq, dtype=torch.float32)
    for row, sample in enumerate(samples):
        start, end = len(sample.prompt_ids), len(sample.prompt_ids) + len(sample.response_ids)
        input_ids[row, :end] = torch.tensor(sample.prompt_ids + sample.response_ids, dtype=torch.long)
        response_mask[row, start:end] = torch.tensor(sample.loss_mask, dtype=torch.bool)
        rollout_log_probs[row, start:end] = torch.tensor(sample.rollout_logprobs, dtype=torch.float32)
    lengths = torch.tensor([len(s.prompt_ids) + len(s.response_ids) for s in samples], dtype=torch.long)
    return ActorBatch(
        input_ids=input_ids,
        lengths=lengths,
        response_mask=response_mask,
        advantages=advantages.to(torch.float32),
        rollout_log_probs=rollout_log_probs,
        routed_experts=_routed_experts(samples, seq),
    )


def _routed_experts(samples: list[RolloutSample], seq: int) -> torch.Tensor | None:
    if any(s.routed_experts is None for s in samples):
        return None
    _, layers, top_k = samples[0].routed_experts.shape
    out = torch.zeros(len(samples), seq, layers, top_k, dtype=torch.long)
    for row, sample in enumerate(samples):
        routed = torch.from_numpy(sample.routed_experts).to(torch.long)
        out[row, : routed.shape[0]] = routed
    return out


def rollout_metrics(groups: list[RolloutGroup], *, max_response_length: int, prefix: str = "train") -> dict[str, float]:
    """Reward, accuracy and length-bias diagnostics of the samples in ``groups``, keys ``<prefix>/...``.

    Keys: ``reward_mean`` (scores with any overlong penalty), ``accuracy``, ``response_length_mean``,
    ``overlong_penalty_mean`` and :func:`~megatron_rl.algorithms.length_bias_metrics`' keys.
    """
    samples = _samples(groups)
    scores = torch.tensor([s.score for s in samples], dtype=torch.float64)
    lengths = torch.tensor([len(s.response_ids) for s in samples], dtype=torch.float64)
    correct = torch.tensor([s.correct for s in samples], dtype=torch.bool)
    truncated = torch.tensor([s.truncated for s in samples], dtype=torch.bool)
    diagnostics = length_bias_metrics(
        lengths, correct, scores, max_response_length=max_response_length, truncated=truncated
    )
    metrics = {
        "reward_mean": scores.mean().item(),
        "accuracy": correct.double().mean().item(),
        "response_length_mean": lengths.mean().item(),
        "overlong_penalty_mean": sum(s.overlong_penalty for s in samples) / len(samples),
    } | diagnostics
    return {f"{prefix}/{name}": value for name, value in metrics.items()}
