"""Reward shaping: DAPO's soft overlong punishment (arXiv 2503.14476, eq. 13).

Shape legend: B responses.

With L_max the max response length and L_cache the buffer before it:

    penalty(|y|) = 0                                       |y| <= L_max - L_cache
                 = ((L_max - L_cache) - |y|) / L_cache * f  L_max - L_cache < |y| <= L_max
                 = -f                                      |y| > L_max

The middle piece falls linearly from 0 to -f across the buffer, so the whole
function is continuous. The penalty is added to the response's score.
"""

from __future__ import annotations

import torch


def overlong_penalty(
    lengths: torch.Tensor, max_response_length: int, buffer_length: int, penalty_factor: float = 1.0
) -> torch.Tensor:
    """Per-response length penalty, [B] float32, in score units (<= 0).

    Args:
        lengths: [B] response lengths in tokens.
        max_response_length: L_max, in tokens, > 0.
        buffer_length: L_cache, in tokens, in (0, max_response_length].
        penalty_factor: f >= 0, the penalty at and beyond L_max is -f.

    Raises:
        ValueError: for ``lengths`` not 1-D or any argument out of its range.
    """
    if lengths.dim() != 1:
        raise ValueError(f"lengths must be [B]; got shape {tuple(lengths.shape)}")
    if max_response_length <= 0:
        raise ValueError(f"max_response_length must be > 0 tokens; got {max_response_length!r}")
    if not 0 < buffer_length <= max_response_length:
        raise ValueError(
            f"buffer_length must be in (0, max_response_length={max_response_length}]; got {buffer_length!r}"
        )
    if penalty_factor < 0:
        raise ValueError(f"penalty_factor must be >= 0; got {penalty_factor!r}")
    expected_length = max_response_length - buffer_length
    inside_buffer_B = (expected_length - lengths.to(torch.float32)) / buffer_length
    return inside_buffer_B.clamp(-1.0, 0.0) * penalty_factor
