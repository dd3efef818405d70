"""From a step's rollout groups to what the trainer receives, and the step's rollout metrics.

B is the number of responses (all samples of all groups, group by group). The step's data is a
ragged :class:`~megatron_rl.actor.step_data.StepData`: each sample is ``prompt_ids +
response_ids``; the engine's log-prob of response token j is that token's entry (log p of it
given what precedes it); ``routed_experts`` of position t routes token t (the engine reports
positions ``0 .. len(prompt) + len(response) - 2``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from megatron_rl.actor.step_data import StepData
from megatron_rl.algorithms import get_advantage_estimator, length_bias_metrics
from megatron_rl.orchestration.trainer_worker import ShardReceipt
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


def assemble_step_data(
    groups: list[RolloutGroup], advantages: torch.Tensor, *, expert_dtype: torch.dtype = torch.uint8
) -> StepData:
    """The step's samples, ragged: int32 token ids, response-only log-probs and loss mask, compact experts.

    Samples keep the groups' order (one mini-batch, resharded by :meth:`StepData.shard`);
    ``routed_experts`` is set only when every sample carries them, cast to ``expert_dtype``
    (:func:`~megatron_rl.actor.step_data.expert_index_dtype` of the model's expert count).
    Raises ValueError when ``advantages`` does not have one value per sample.
    """
    samples = _samples(groups)
    if tuple(advantages.shape) != (len(samples),):
        raise ValueError(f"advantages must be [B] = ({len(samples)},); got {tuple(advantages.shape)}")
    lengths = torch.tensor([len(s.prompt_ids) + len(s.response_ids) for s in samples], dtype=torch.long)
    routed = None
    experts = [s.routed_experts for s in samples if s.routed_experts is not None]
    if len(experts) == len(samples):
        routed = _concatenated(experts, _numpy(expert_dtype))
    return StepData(
        token_ids=_concatenated([part for s in samples for part in (s.prompt_ids, s.response_ids)], np.int32),
        offsets=torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)]),
        prompt_lengths=torch.tensor([len(s.prompt_ids) for s in samples], dtype=torch.long),
        advantages=advantages.to(torch.float32),
        loss_mask=_concatenated([s.loss_mask for s in samples], np.bool_),
        rollout_log_probs=_concatenated([s.rollout_logprobs for s in samples], np.float32),
        routed_experts=routed,
        sample_ids=torch.arange(len(samples)),
        mini_batch_sizes=(len(samples),),
    )


def _concatenated(parts: Sequence[Sequence[float] | np.ndarray], dtype: np.dtype | type) -> torch.Tensor:
    """``parts`` back to back along dim 0 as one ``dtype`` tensor, cast in the same pass as the copy.

    The cast is unchecked: callers pick a ``dtype`` that holds every value (token ids, expert indices).
    """
    arrays = [np.asarray(part) for part in parts]
    if all(array.dtype == dtype for array in arrays):  # numpy's casting path is several times slower
        return torch.from_numpy(np.concatenate(arrays))
    return torch.from_numpy(np.concatenate(arrays, dtype=dtype, casting="unsafe"))


def _numpy(dtype: torch.dtype) -> np.dtype:
    return torch.empty(0, dtype=dtype).numpy().dtype


def rollout_metrics(groups: list[RolloutGroup], *, max_response_length: int, prefix: str = "train") -> dict[str, float]:
    """Reward, accuracy and length-bias diagnostics of the samples in ``groups``, keys ``<prefix>/...``.

    Keys: ``reward_mean`` (scores with any overlong penalty), ``accuracy``, ``response_length_mean`` (every
    response token, environment replies included), ``overlong_penalty_mean``, ``turns_mean`` and
    :func:`~megatron_rl.algorithms.length_bias_metrics`' keys, whose lengths are the tokens the policy
    sampled (``length_mean``: the same as ``response_length_mean`` in single-turn episodes).
    """
    samples = _samples(groups)
    scores = torch.tensor([s.score for s in samples], dtype=torch.float64)
    lengths = torch.tensor([len(s.response_ids) for s in samples], dtype=torch.float64)
    sampled = torch.tensor([s.sampled_tokens for s in samples], dtype=torch.float64)
    correct = torch.tensor([s.correct for s in samples], dtype=torch.bool)
    truncated = torch.tensor([s.truncated for s in samples], dtype=torch.bool)
    diagnostics = length_bias_metrics(
        sampled, correct, scores, max_response_length=max_response_length, truncated=truncated
    )
    metrics = {
        "reward_mean": scores.mean().item(),
        "accuracy": correct.double().mean().item(),
        "response_length_mean": lengths.mean().item(),
        "overlong_penalty_mean": sum(s.overlong_penalty for s in samples) / len(samples),
        "turns_mean": sum(s.turns for s in samples) / len(samples),
    } | diagnostics
    return {f"{prefix}/{name}": value for name, value in metrics.items()}


def delivery_metrics(step: StepData, receipts: Sequence[ShardReceipt], *, data_parallel_size: int) -> dict[str, float]:
    """What the step's data cost to deliver: ``data/step_bytes``, per-rank bytes and samples, and their ratio.

    ``data/rank_bytes_over_fair`` is the busiest rank's bytes over ``step bytes / DP`` (1.0 when
    every rank receives exactly its share and nothing else).
    """
    step_bytes = step.nbytes()
    rank_bytes = [receipt.nbytes for receipt in receipts]
    rank_samples = [len(receipt.sample_ids) for receipt in receipts]
    return {
        "data/step_samples": float(step.num_samples),
        "data/step_bytes": float(step_bytes),
        "data/rank_bytes_max": float(max(rank_bytes)),
        "data/rank_bytes_over_fair": max(rank_bytes) / (step_bytes / data_parallel_size),
        "data/rank_samples_max": float(max(rank_samples)),
        "data/rank_samples_min": float(min(rank_samples)),
    }
