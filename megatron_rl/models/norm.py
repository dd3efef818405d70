"""RMSNorm for Megatron's local (non Transformer Engine) layer spec.

Megatron-core's local spec builds ``torch.nn.RMSNorm`` through a wrapper that
refuses sequence parallelism, which MoE with TP > 1 requires. This module is
the same normalisation (computed in fp32 like Hugging Face's Qwen3RMSNorm),
and it marks its weight ``sequence_parallel`` so that Megatron all-reduces its
gradient across the TP group when sequence parallelism is on.
"""

from __future__ import annotations

import torch
from megatron.core.transformer import TransformerConfig


class RMSNorm(torch.nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dimension.

    Shapes: input ``[..., hidden_size]`` -> output of the same shape and dtype.
    The constructor follows Megatron's ``LayerNormBuilder`` protocol.
    """

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-6, **_: object) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        # Megatron's finalize_model_grads reads this flag: it all-reduces flagged grads over the TP group.
        self.weight.sequence_parallel = config.sequence_parallel  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_fp32 = x.float()
        normed = x_fp32 * torch.rsqrt(x_fp32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)
