"""Finished groups to training groups: responses scored, shaped by the overlong penalty, masked, filtered.

A group whose responses have all ended is scored in the reward worker processes (a response whose
reward raises or runs past ``data.reward_timeout_s`` scores as failed, see ``scoring``); each
response then gets the DAPO overlong penalty added to its score (on its whole length, environment
replies included, as the length budget counts them) and, with overlong filtering, a zero loss mask when
truncated; tokens an environment appended (multi-turn episodes) always have loss mask 0. Dynamic sampling keeps a group only when its correctness
(``metric: acc``, the default) or scores (``metric: score``) vary (:func:`group_has_signal`).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING

import torch

from megatron_rl.algorithms import groups_with_signal, overlong_penalty
from megatron_rl.rollout.groups import RolloutGroup, RolloutSample
from megatron_rl.rollout.partial import PartialGroup
from megatron_rl.rollout.scoring import RewardPool, ScoredResponse

if TYPE_CHECKING:
    from megatron_rl.config.schema import DynamicSamplingConfig, OverlongConfig
    from megatron_rl.data.rewards import ServedReward


def group_has_signal(group: RolloutGroup, metric: str) -> bool:
    """Whether dynamic sampling keeps ``group``: its responses' ``metric`` values differ.

    ``acc``: correctness (the DAPO paper's 0 < #correct < G; shaped scores such as the overlong
    penalty are no signal); ``score``: the shaped scores.
    """
    values = [float(s.correct) for s in group.samples] if metric == "acc" else group.scores
    return bool(groups_with_signal(torch.tensor(values), [0] * len(values)).all())


class GroupAssembler:
    """Scores finished :class:`PartialGroup` s and turns them into shaped, masked :class:`RolloutGroup` s.

    ``decode`` turns response ids into the text the reward reads (and, for a served reward, the prompt's ids
    into the prompt it is sent with); ``served_reward``: the served reward of ``reward="remote"`` or ``"judge"``.
    :meth:`close` stops the reward workers.
    """

    def __init__(
        self,
        overlong: OverlongConfig,
        dynamic_sampling: DynamicSamplingConfig,
        max_response_length: int,
        *,
        reward: str,
        reward_num_workers: int,
        reward_timeout_s: float,
        decode: Callable[[list[int]], str],
        served_reward: ServedReward | None = None,
    ) -> None:
        self.overlong, self.dynamic_sampling = overlong, dynamic_sampling
        self.max_response_length = max_response_length
        self.decode = decode
        self.rewards = RewardPool(reward, reward_num_workers, timeout_s=reward_timeout_s, served=served_reward)

    def score(self, group: PartialGroup) -> Future[list[ScoredResponse]]:
        """Future of the finished ``group``'s scores, one per response, in order."""
        texts = [self.decode(sample.output_ids) for sample in group.samples]
        item = group.item
        # Local rewards never see the prompt: decoding it for them would be wasted work.
        prompt = self.decode(list(item.prompt_ids)) if self.rewards.served is not None else ""
        return self.rewards.submit(texts, item.ground_truth, item.extra_info, label=group.uid, prompt=prompt)

    def assemble(self, group: PartialGroup, scored: list[ScoredResponse]) -> RolloutGroup:
        """The finished ``group`` as a training group: ``scored`` plus the overlong penalty, loss masks."""
        item = group.item
        lengths = torch.tensor([len(s.output_ids) for s in group.samples])
        penalties = torch.zeros(len(group.samples))
        if self.overlong.enable:
            penalties = overlong_penalty(
                lengths, self.max_response_length, self.overlong.buffer_length, self.overlong.penalty_factor
            )
        samples = []
        for sample, reward, penalty in zip(group.samples, scored, penalties.tolist(), strict=True):
            assert sample.finish_reason is not None, "a group is assembled only after its first window"
            truncated = sample.finish_reason.type == "length"
            keep_tokens = 0 if truncated and self.overlong.filter_truncated else 1
            policy = sample.policy_mask or [1] * len(sample.output_ids)  # replies' tokens are not trained on
            samples.append(
                RolloutSample(
                    prompt_ids=list(item.prompt_ids),
                    response_ids=list(sample.output_ids),
                    rollout_logprobs=list(sample.output_logprobs),
                    finish_reason=sample.finish_reason.type,
                    score=reward.score + penalty,
                    correct=reward.correct,
                    overlong_penalty=penalty,
                    loss_mask=[keep_tokens * sampled for sampled in policy],
                    weight_version=sample.weight_version,
                    routed_experts=sample.routed_experts,
                    reward_failure=reward.failure,
                    version_segments=list(sample.version_segments),
                    policy_tokens=None if sample.policy_mask is None else sum(sample.policy_mask),
                    turns=sample.turns,
                    tools=sample.tools,
                    answer=reward.answer,
                )
            )
        return RolloutGroup(uid=group.uid, prompt_index=item.index, samples=samples)

    def has_signal(self, group: RolloutGroup) -> bool:
        """Whether the step may keep ``group``: always without dynamic sampling, else :func:`group_has_signal`."""
        return not self.dynamic_sampling.enable or group_has_signal(group, self.dynamic_sampling.metric)

    def close(self) -> None:
        """Stop the reward workers."""
        self.rewards.close()
