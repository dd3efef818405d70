"""Group-relative advantages (GRPO and Dr.GRPO).

Shape legend: B responses, T response tokens (padded).

For a response i in group g (the responses to one prompt, identified by id):

* GRPO:    A_i = (s_i - mean_g) / (std_g + eps), std unbiased (n - 1)
* Dr.GRPO: A_i = s_i - mean_g                    (``norm_by_std=False``)

A group of one response has no baseline to compare against: its advantage is
defined as 0 (its unbiased std is undefined), so it contributes no gradient.
A group whose scores are all equal also gets 0 everywhere.
"""

from __future__ import annotations

import torch

from megatron_rl.algorithms.groups import GroupIds, group_index, group_mean_std
from megatron_rl.algorithms.masking import as_bool_mask
from megatron_rl.algorithms.registry import register_advantage_estimator


@register_advantage_estimator("grpo")
def grpo_advantages(
    scores: torch.Tensor, group_ids: GroupIds, norm_by_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """Per-response group-relative advantage, [B].

    Args:
        scores: [B] score of each response (sum of its token rewards).
        group_ids: [B] integer tensor or length-B sequence of hashable uids;
            responses with equal ids form a group, wherever they sit.
        norm_by_std: divide by the group std (GRPO); False gives Dr.GRPO.
        eps: added to the std before dividing; must be > 0 so that a group
            with equal scores gets 0, not NaN. Unused when ``norm_by_std`` is False.

    Returns:
        [B] advantages on ``scores``' device, float32 (float64 for float64
        scores). Callers pass detached scores; advantages are constants of the loss.

    Raises:
        ValueError: ``scores`` not 1-D, ``eps`` not positive, or bad ``group_ids``.
    """
    if scores.dim() != 1:
        raise ValueError(f"scores must be [B]; got shape {tuple(scores.shape)}")
    if not eps > 0:
        raise ValueError(f"eps must be > 0; got {eps!r}")
    index_B, num_groups = group_index(group_ids, scores.numel(), scores.device)
    mean_B, std_B = group_mean_std(scores, index_B, num_groups)
    centred_B = scores.to(mean_B.dtype) - mean_B
    return centred_B / (std_B + eps) if norm_by_std else centred_B


def expand_to_tokens(advantages_B: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """Broadcast per-response advantages over response tokens: [B] -> [B, T], 0 where masked."""
    if advantages_B.dim() != 1 or mask_BT.dim() != 2 or advantages_B.shape[0] != mask_BT.shape[0]:
        raise ValueError(
            f"advantages must be [B] and mask [B, T] with the same B; "
            f"got {tuple(advantages_B.shape)} and {tuple(mask_BT.shape)}"
        )
    advantages_BT = advantages_B.unsqueeze(-1).expand(mask_BT.shape)
    valid_BT = as_bool_mask(mask_BT, advantages_BT)
    return torch.where(valid_BT, advantages_BT, torch.zeros_like(advantages_BT))
