"""Forward-only pass of this rank's model chunks through Megatron's pipeline schedule.

:func:`forward_logits` feeds micro-batches of token ids through
``get_forward_backward_func`` (no pipelining, 1F1B or interleaved, as the
parallel state dictates) and returns, on the last pipeline stage, each
micro-batch's vocabulary-parallel logits ``[B, S, Vp/tp]`` (this TP rank's
slice of the padded vocabulary). Other stages get an empty list.

Every micro-batch must have the same shape ``[B, S]`` (CPU runs use fixed
sequence lengths per call), and with sequence parallelism ``S`` must be a
multiple of the TP size. Attention is causal; right padding is harmless to
the positions before it (padded positions' outputs are garbage, mask them).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func


def _forward_step(data_iterator, model):
    batch = next(data_iterator)
    logits = model(batch["input_ids"], batch["position_ids"], None)
    return logits, lambda output, non_loss_data=True: output


@torch.no_grad()
def forward_logits(chunks: Sequence[torch.nn.Module], micro_batches: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Vocab-parallel logits of each micro-batch ``[B, S]`` (last pipeline stage only).

    With virtual pipeline parallelism Megatron needs at least ``pp``
    micro-batches. Context parallelism is not supported here yet (the
    sequence would have to be split across CP ranks): NotImplementedError.
    """
    if parallel_state.get_context_parallel_world_size() > 1:
        raise NotImplementedError("forward_logits does not split sequences for context parallelism (cp > 1)")
    batch_size, seq_length = micro_batches[0].shape
    if any(tuple(mb.shape) != (batch_size, seq_length) for mb in micro_batches):
        raise ValueError("all micro-batches must have the same [batch, sequence] shape")
    position_ids = torch.arange(seq_length, device=micro_batches[0].device).expand(batch_size, -1)
    batches = [{"input_ids": mb, "position_ids": position_ids} for mb in micro_batches]
    for chunk in chunks:
        chunk.eval()
    iterators = [iter(batches) for _ in chunks] if len(chunks) > 1 else iter(batches)
    outputs = get_forward_backward_func()(
        forward_step_func=_forward_step,
        data_iterator=iterators,
        model=list(chunks),
        num_microbatches=len(batches),
        seq_length=seq_length,
        micro_batch_size=batch_size,
        forward_only=True,
        collect_non_loss_data=True,
    )
    return list(outputs)
