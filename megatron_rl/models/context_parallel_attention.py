"""Core attention of the local (no Transformer Engine) layer spec under context parallelism.

Megatron-core's own ``DotProductAttention`` refuses ``context_parallel_size > 1``; only
Transformer Engine's attention splits sequences. :class:`AllGatherContextAttention` is the
local stand-in, the all-gather scheme (TE's ``cp_comm_type="all_gather"``): each CP rank keeps
its queries (the load-balanced chunks of ``parallel.context_parallel``), gathers every rank's
keys and values into the whole sequence, and masks causally by global position. The
attention itself is ``DotProductAttention``'s, so CP 1 and CP > 1 compute the same scores.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

from megatron_rl.parallel.context_parallel import gather_sequence, local_positions


class AllGatherContextAttention(DotProductAttention):
    """``DotProductAttention`` over the whole sequence's keys and values for this CP rank's queries.

    Inputs are Megatron's ``[s_local, b, heads, head_dim]`` with ``s_local = S / cp`` in the
    load-balanced order; the output is ``[s_local, b, heads * head_dim]`` for the same positions.
    Causal self-attention on right-padded rows only (no packed sequences, no extra mask).
    """

    def __init__(self, config: TransformerConfig, *args: Any, **kwargs: Any) -> None:
        # DotProductAttention asserts cp == 1; only that check reads the size (copy: not __post_init__ again).
        single = copy.copy(config)
        single.context_parallel_size = 1
        super().__init__(single, *args, **kwargs)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        if attention_mask is not None or packed_seq_params is not None:
            raise ValueError("context-parallel local attention supports causal attention on padded rows only")
        group = parallel_state.get_context_parallel_group()
        key = gather_sequence(key, 0, group, grads="sum")
        value = gather_sequence(value, 0, group, grads="sum")
        seq_length = key.shape[0]
        query_positions = local_positions(seq_length, group.size(), group.rank(), query.device)
        future = torch.arange(seq_length, device=query.device).unsqueeze(0) > query_positions.unsqueeze(1)
        output: torch.Tensor = super().forward(
            query, key, value, future.view(1, 1, *future.shape), attn_mask_type, attention_bias
        )
        return output
