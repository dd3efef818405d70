"""Forward-only passes of this rank's model chunks through Megatron's pipeline schedule.

:func:`run_pipeline_schedule` is the forward-only ``get_forward_backward_func`` call (no
pipelining, 1F1B or interleaved, as the parallel state dictates) that parity
(:func:`forward_logits`) and the actor's log-prob pass (``actor.batch_logprobs``) share; the
training step calls Megatron's schedule itself (``actor.train_step``).

:func:`forward_logits` feeds micro-batches of token ids through it and returns, on the last
pipeline stage, each micro-batch's vocabulary-parallel logits ``[B, S, Vp/tp]`` (this TP rank's
slice of the padded vocabulary). Other stages get an empty list.

Every micro-batch must have the same shape ``[B, S]`` (CPU runs use fixed
sequence lengths per call), and with sequence parallelism ``S`` must be a
multiple of the TP size. Attention is causal; right padding is harmless to
the positions before it (padded positions' outputs are garbage, mask them).
With context parallelism each CP rank runs its load-balanced share of every
row (``S`` a multiple of ``2 * cp``, times the TP size with sequence
parallelism) and the logits are gathered back into whole rows.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_rl.parallel.context_parallel import gather_sequence, split_sequence


def _forward_step(
    data_iterator: Iterator[dict[str, torch.Tensor]], model: torch.nn.Module
) -> tuple[torch.Tensor, Callable[..., Any]]:
    batch = next(data_iterator)
    logits = model(batch["input_ids"], batch["position_ids"], None)
    return logits, lambda output, non_loss_data=True: output


def run_pipeline_schedule(
    chunks: Sequence[torch.nn.Module],
    forward_step: Callable[..., Any],
    inputs: Sequence[Any],
    *,
    micro_batch_size: int,
    seq_length: int,
) -> list[Any]:
    """One forward-only ``get_forward_backward_func`` call over ``inputs`` (one item per micro-batch).

    Each model chunk (virtual pipeline stage) gets its own iterator over ``inputs``. The result is
    the forward step's non-loss outputs, one per micro-batch, as Megatron collects them (on the
    last pipeline stage; empty elsewhere).
    """
    iterators = [iter(inputs) for _ in chunks] if len(chunks) > 1 else iter(inputs)
    outputs = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iterators,
        model=list(chunks),
        num_microbatches=len(inputs),
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        forward_only=True,
        collect_non_loss_data=True,
    )
    return list(outputs)


@torch.no_grad()
def forward_logits(chunks: Sequence[torch.nn.Module], micro_batches: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Vocab-parallel logits of each micro-batch ``[B, S]`` (last pipeline stage only).

    With virtual pipeline parallelism Megatron needs at least ``pp``
    micro-batches. With context parallelism every CP rank returns the whole rows' logits.
    """
    batch_size, seq_length = micro_batches[0].shape
    if any(tuple(mb.shape) != (batch_size, seq_length) for mb in micro_batches):
        raise ValueError("all micro-batches must have the same [batch, sequence] shape")
    position_ids = torch.arange(seq_length, device=micro_batches[0].device).expand(batch_size, -1)
    cp_group = parallel_state.get_context_parallel_group()
    context_parallel = cp_group.size() > 1
    if context_parallel:
        position_ids = split_sequence(position_ids, 1, cp_group)
        micro_batches = [split_sequence(mb, 1, cp_group) for mb in micro_batches]
    batches = [{"input_ids": mb, "position_ids": position_ids} for mb in micro_batches]
    for chunk in chunks:
        chunk.eval()
    logits = run_pipeline_schedule(chunks, _forward_step, batches, micro_batch_size=batch_size, seq_length=seq_length)
    return [gather_sequence(part, 1, cp_group, grads="own") for part in logits] if context_parallel else logits
