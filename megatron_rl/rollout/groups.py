"""What a rollout step hands to the trainer: groups of scored samples, identified by uid.

Shape legend for :meth:`RolloutBatch.padded`: B samples, P longest prompt,
R longest response.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class RolloutSample:
    """One response. ``loss_mask`` is 1 per response token (0 everywhere when overlong-filtered).

    ``score`` includes the overlong penalty (``overlong_penalty`` holds it alone);
    ``routed_experts`` is int32 ``[prompt + response - 1, layers, top_k]`` or None.
    """

    prompt_ids: list[int]
    response_ids: list[int]
    rollout_logprobs: list[float]
    finish_reason: str
    score: float
    correct: bool
    overlong_penalty: float
    loss_mask: list[int]
    weight_version: str | None
    routed_experts: np.ndarray | None = None

    @property
    def truncated(self) -> bool:
        """True when the response hit the length limit."""
        return self.finish_reason == "length"


@dataclass
class RolloutGroup:
    """The n samples of one prompt; ``uid`` is unique within the run, ``prompt_index`` is the dataset index."""

    uid: str
    prompt_index: int
    samples: list[RolloutSample]

    @property
    def scores(self) -> list[float]:
        """The samples' scores, in order."""
        return [s.score for s in self.samples]


@dataclass
class RolloutBatch:
    """A step's kept groups and the rollout metrics (counts of kept/dropped/aborted groups among them)."""

    groups: list[RolloutGroup]
    metrics: dict[str, float] = field(default_factory=dict)

    def padded(self, pad_token_id: int = 0) -> dict[str, torch.Tensor]:
        """Right-padded tensors of all samples, group by group.

        ``prompt_ids`` [B, P] (right-padded), ``response_ids`` [B, R], ``response_mask``
        [B, R] (loss mask), ``rollout_logprobs`` [B, R] fp32, ``scores`` [B] fp32,
        ``group_index`` [B] int64 (position of the sample's group in ``groups``).
        """
        samples = [(g_index, s) for g_index, g in enumerate(self.groups) for s in g.samples]
        num, prompt_len = len(samples), max(len(s.prompt_ids) for _, s in samples)
        response_len = max(1, max(len(s.response_ids) for _, s in samples))
        out = {
            "prompt_ids": torch.full((num, prompt_len), pad_token_id, dtype=torch.long),
            "response_ids": torch.full((num, response_len), pad_token_id, dtype=torch.long),
            "response_mask": torch.zeros(num, response_len, dtype=torch.long),
            "rollout_logprobs": torch.zeros(num, response_len, dtype=torch.float32),
            "scores": torch.tensor([s.score for _, s in samples], dtype=torch.float32),
            "group_index": torch.tensor([g for g, _ in samples], dtype=torch.long),
        }
        for row, (_, sample) in enumerate(samples):
            length = len(sample.response_ids)
            out["prompt_ids"][row, : len(sample.prompt_ids)] = torch.tensor(sample.prompt_ids)
            out["response_ids"][row, :length] = torch.tensor(sample.response_ids, dtype=torch.long)
            out["response_mask"][row, :length] = torch.tensor(sample.loss_mask, dtype=torch.long)
            out["rollout_logprobs"][row, :length] = torch.tensor(sample.rollout_logprobs)
        return out
