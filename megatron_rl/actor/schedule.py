"""One call of Megatron-core's pipeline schedule over equally shaped micro-batches.

:func:`run_schedule` feeds :class:`RolloutBatch` micro-batches through
``get_forward_backward_func`` (no pipelining, 1F1B or interleaved, as the
parallel state dictates), forward-only or forward-backward. Per micro-batch it
sets the routers' replay targets (when replaying) right before the model's
forward, and hands the last stage's vocab-parallel logits to ``loss_fn``.

Position ids are 0..S-1 for every row and attention is causal: right padding
never influences the positions before it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_rl.actor.batch import RolloutBatch
from megatron_rl.actor.routing_replay import RoutingReplay

# loss_fn(micro_batch, logits [B, S, V/tp]) -> Megatron's loss_func result.
LossFn = Callable[[RolloutBatch, torch.Tensor], Any]


def run_schedule(
    models: Sequence[torch.nn.Module],
    micro_batches: Sequence[RolloutBatch],
    loss_fn: LossFn,
    *,
    forward_only: bool,
    replay: RoutingReplay | None = None,
) -> list[Any]:
    """Run the schedule; return what ``loss_fn`` produced per micro-batch (last pipeline stage; else ``[]``).

    All micro-batches must share one ``[B, S]`` shape. Forward-only runs
    collect ``loss_fn``'s return value as non-loss data; training runs follow
    Megatron's ``loss_func`` contract ``(loss, num_tokens, log_dict)`` and
    return the log dicts.
    """
    batch_size, seq_length = micro_batches[0].input_ids.shape
    position_ids = torch.arange(seq_length, device=micro_batches[0].input_ids.device).expand(batch_size, -1)

    def forward_step(data_iterator, model):
        micro_batch = next(data_iterator)
        if replay is not None:
            replay.set_micro_batch(micro_batch)
        logits = model(micro_batch.input_ids, position_ids, None)

        def loss_func(output: torch.Tensor, non_loss_data: bool = False) -> Any:
            return loss_fn(micro_batch, output)

        return logits, loss_func

    for model in models:
        model.eval() if forward_only else model.train()
    iterators = [iter(micro_batches) for _ in models] if len(models) > 1 else iter(micro_batches)
    with replay.replaying() if replay is not None else contextlib.nullcontext():
        outputs = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iterators,
            model=list(models),
            num_microbatches=len(micro_batches),
            seq_length=seq_length,
            micro_batch_size=batch_size,
            forward_only=forward_only,
            collect_non_loss_data=forward_only,
        )
    return list(outputs)
