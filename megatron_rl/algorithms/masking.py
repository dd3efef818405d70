"""Reductions over the valid tokens of a masked [B, T] tensor.

These are the local (this shard only) statistics that metrics are built from.
Loss reduction over a whole optimizer step lives in ``aggregation``.

Shape legend: B responses in the shard, T response tokens (padded).

A mask marks valid tokens; any non-zero entry is valid. Padded positions may
hold garbage (including inf or NaN log-probs): every function here selects with
``torch.where`` instead of multiplying by the mask, so padding never leaks into
a value or a gradient.
"""

from __future__ import annotations

import torch


def as_bool_mask(mask_BT: torch.Tensor, like_BT: torch.Tensor, name: str = "mask") -> torch.Tensor:
    """Return ``mask_BT != 0`` as bool, after checking it has ``like_BT``'s shape.

    Raises:
        ValueError: if the shapes differ; the message names ``name``.
    """
    if mask_BT.shape != like_BT.shape:
        raise ValueError(
            f"{name} must have the shape of the values it masks, {tuple(like_BT.shape)}; got {tuple(mask_BT.shape)}"
        )
    return mask_BT if mask_BT.dtype == torch.bool else mask_BT != 0


def masked_sum(values_BT: torch.Tensor, valid_BT: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``values_BT`` over valid positions (all dims, or ``dim``).

    ``valid_BT`` is a bool mask of the same shape. Invalid positions contribute
    exactly 0 to the value and to the gradient, whatever they hold.
    """
    selected = torch.where(valid_BT, values_BT, torch.zeros_like(values_BT))
    return selected.sum() if dim is None else selected.sum(dim=dim)


def masked_mean(values_BT: torch.Tensor, valid_BT: torch.Tensor) -> torch.Tensor:
    """Mean of ``values_BT`` over all valid positions; 0 when there are none (0-dim)."""
    num_valid = valid_BT.sum().clamp(min=1)
    return masked_sum(values_BT, valid_BT) / num_valid


def masked_max(values_BT: torch.Tensor, valid_BT: torch.Tensor) -> torch.Tensor:
    """Maximum of ``values_BT`` over valid positions; 0 when there are none (0-dim)."""
    if values_BT.numel() == 0:
        return values_BT.new_zeros(())
    lowest = torch.finfo(values_BT.dtype).min
    largest = torch.where(valid_BT, values_BT, torch.full_like(values_BT, lowest)).max()
    return torch.where(valid_BT.any(), largest, torch.zeros_like(largest))


def masked_fraction(condition_BT: torch.Tensor, valid_BT: torch.Tensor) -> torch.Tensor:
    """Fraction of valid positions where the bool ``condition_BT`` holds (0-dim, float32)."""
    return masked_mean(condition_BT.to(torch.float32), valid_BT)
