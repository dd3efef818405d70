"""Identify response groups by id and compute per-group statistics, vectorised.

A group is the set of responses sampled for one prompt. Groups are identified
by an id (the prompt uid), never by position: the responses of a group may sit
anywhere in the batch, interleaved with other groups.

Shape legend: B responses, G distinct groups among them.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

GroupIds = torch.Tensor | Sequence[Hashable]


def group_index(group_ids: GroupIds, num_responses: int, device: torch.device) -> tuple[torch.Tensor, int]:
    """Map each response to a dense group index.

    Args:
        group_ids: a [B] integer tensor, or a length-B sequence of hashable
            uids (e.g. strings). Equal ids mean the same group.
        num_responses: B, to check ``group_ids`` against.
        device: where the returned index lives.

    Returns:
        ``(index_B, G)``: int64 indices in ``[0, G)``, and G.

    Raises:
        ValueError: wrong length, a non-1-D or floating-point tensor, or a bare
            string (which would be read as a sequence of characters).
    """
    if isinstance(group_ids, torch.Tensor):
        if group_ids.dim() != 1 or group_ids.is_floating_point() or group_ids.is_complex():
            raise ValueError(
                f"group_ids as a tensor must be 1-D with an integer dtype; "
                f"got shape {tuple(group_ids.shape)}, dtype {group_ids.dtype}"
            )
        if group_ids.numel() != num_responses:
            raise ValueError(f"group_ids must have {num_responses} entries (one per response); got {group_ids.numel()}")
        unique_G, index_B = torch.unique(group_ids, return_inverse=True)
        return index_B.to(device=device, dtype=torch.long), unique_G.numel()
    if isinstance(group_ids, (str, bytes)):
        raise ValueError(f"group_ids must be a sequence of uids, not a single string; got {group_ids!r}")
    uids = list(group_ids)
    if len(uids) != num_responses:
        raise ValueError(f"group_ids must have {num_responses} entries (one per response); got {len(uids)}")
    dense_of: dict[Hashable, int] = {}
    index = [dense_of.setdefault(uid, len(dense_of)) for uid in uids]
    return torch.tensor(index, dtype=torch.long, device=device), len(dense_of)


def stats_dtype(dtype: torch.dtype) -> torch.dtype:
    """Float dtype to compute statistics in: at least float32, float64 kept."""
    return torch.promote_types(dtype, torch.float32) if dtype.is_floating_point else torch.float32


def group_mean_std(values_B: torch.Tensor, index_B: torch.Tensor, num_groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each response's group mean and unbiased (n - 1) group std, both [B].

    A group of one response has std 0 by definition (the unbiased std is
    undefined there). Two-pass: deviations are taken from the group mean.
    """
    values_B = values_B.to(stats_dtype(values_B.dtype))
    count_G = torch.bincount(index_B, minlength=num_groups).to(values_B.dtype)
    sum_G = values_B.new_zeros(num_groups).index_add_(0, index_B, values_B)
    mean_B = (sum_G / count_G)[index_B]
    sq_dev_G = values_B.new_zeros(num_groups).index_add_(0, index_B, (values_B - mean_B) ** 2)
    var_G = sq_dev_G / (count_G - 1).clamp(min=1)
    return mean_B, var_G.sqrt()[index_B]


def group_range(values_B: torch.Tensor, index_B: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Each response's group range, max - min over its group, [B]."""
    values_B = values_B.to(stats_dtype(values_B.dtype))
    empty_G = values_B.new_zeros(num_groups)
    max_G = empty_G.scatter_reduce(0, index_B, values_B, reduce="amax", include_self=False)
    min_G = empty_G.scatter_reduce(0, index_B, values_B, reduce="amin", include_self=False)
    return (max_G - min_G)[index_B]
