"""DAPO dynamic sampling: keep only groups whose scores carry a learning signal.

Shape legend: B responses.

A group whose responses are all right or all wrong carries no learning signal;
DAPO keeps a group only when 0 < #correct < G and over-samples to refill the
batch (arXiv 2503.14476, section 3.2). The filter takes any per-response
values: correctness as 0/1 (the paper's accuracy filter, the rollout manager's
default) or the shaped scores (verl's ``metric=score``).
"""

from __future__ import annotations

import torch

from megatron_rl.algorithms.groups import GroupIds, group_index, group_range

SIGNAL_ATOL = 1e-6


def groups_with_signal(scores: torch.Tensor, group_ids: GroupIds, *, atol: float = SIGNAL_ATOL) -> torch.Tensor:
    """Keep-mask [B] bool: True for every response of a group whose scores differ.

    A group is kept when max - min of its scores exceeds ``atol`` (scores in
    the same units as the rewards; the default 1e-6 only absorbs float noise).
    A group of one response has range 0 and is dropped. Groups are identified
    by id, so their responses may be interleaved.

    Args:
        scores: [B] float scores.
        group_ids: [B] integer tensor or length-B sequence of hashable uids.
        atol: tolerance on the range, >= 0.

    Raises:
        ValueError: ``scores`` not 1-D, negative ``atol``, or bad ``group_ids``.
    """
    if scores.dim() != 1:
        raise ValueError(f"scores must be [B]; got shape {tuple(scores.shape)}")
    if atol < 0:
        raise ValueError(f"atol must be >= 0; got {atol!r}")
    index_B, num_groups = group_index(group_ids, scores.numel(), scores.device)
    return group_range(scores, index_B, num_groups) > atol
