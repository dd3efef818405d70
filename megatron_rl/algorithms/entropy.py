"""Entropy of categorical distributions given by logits.

Shape legend: V vocabulary (the last dim); any leading dims (e.g. B, T).
"""

from __future__ import annotations

import torch


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy in nats over the last dim: logits [..., V] -> [...], float32 (float64 kept).

    Computed as -sum(p * log p) from ``log_softmax`` (logsumexp-stable), in at
    least float32, so bf16/fp16 logits are fine. Logits of -inf (masked-out
    vocabulary) contribute 0 to the value and to the gradient, never NaN.
    This materialises a few [..., V] float32 temporaries: for large T * V,
    call it on chunks of tokens (or use a vocab-parallel variant).

    Raises:
        ValueError: for a 0-dim ``logits``.
    """
    if logits.dim() == 0:
        raise ValueError("logits must have a vocabulary dim (shape [..., V]); got a 0-dim tensor")
    logits_V = logits.to(torch.promote_types(logits.dtype, torch.float32))
    log_probs_V = torch.log_softmax(logits_V, dim=-1)
    probs_V = log_probs_V.exp()
    finite_log_probs_V = torch.where(probs_V > 0, log_probs_V, torch.zeros_like(log_probs_V))
    return -(probs_V * finite_log_probs_V).sum(dim=-1)
