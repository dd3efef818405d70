"""From a data-parallel rank's rows to its equally shaped micro-batches.

The rows are this rank's own (its ``StepData`` shard, balanced over the DP ranks by the
driver); both steps below agree with the other DP ranks so that every rank runs the same
schedule:

1. :func:`plan_micro_batches`: token-budget micro-batches with the count made
   equal on every DP rank (local plan, all-reduce MAX, plan again).
2. :func:`padded_micro_batches`: every micro-batch padded to one common
   ``[rows, S]`` shape, agreed on by all DP ranks (MAX all-reduce). The CPU
   MoE dispatcher (allgather) and pipeline p2p without
   ``variable_seq_lengths`` need one shape per schedule call; padding rows
   carry no loss token. ``S`` is a multiple of ``seq_multiple``
   (``packing.padded_sequence_multiple``: the TP size for sequence parallelism,
   times the FP8 token alignment when training in FP8, times ``2 * cp`` with
   context parallelism).

:func:`local_micro_batches` does both for the actor.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_rl.actor.batch import ActorBatch
from megatron_rl.actor.packing import padded_sequence_multiple
from megatron_rl.data.micro_batching import token_budget_micro_batches
from megatron_rl.parallel.device import select_device


def _max_over(values: Sequence[int], group: dist.ProcessGroup | None) -> list[int]:
    tensor = torch.tensor(list(values), dtype=torch.int64, device=select_device())
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return tensor.tolist()


def plan_micro_batches(
    lengths: Sequence[int], max_tokens_per_micro_batch: int, group: dist.ProcessGroup | None
) -> list[list[int]]:
    """Token-budget micro-batches of this rank's rows, as many as on the busiest DP rank of ``group``.

    Every index of ``lengths`` appears once; each micro-batch holds at most
    ``max_tokens_per_micro_batch`` tokens (see ``token_budget_micro_batches``).
    """
    local = token_budget_micro_batches(lengths, max_tokens_per_micro_batch)
    (count,) = _max_over([len(local)], group)
    if count == len(local):
        return local
    return token_budget_micro_batches(lengths, max_tokens_per_micro_batch, min_num_micro_batches=count)


def padded_micro_batches(
    batch: ActorBatch, plan: Sequence[Sequence[int]], group: dist.ProcessGroup | None, seq_multiple: int = 1
) -> list[ActorBatch]:
    """The micro-batches of ``plan`` (row lists into ``batch``), padded to a shape shared by all DP ranks."""
    rows = max(len(part) for part in plan)
    seq_length = int(batch.lengths.max())
    rows, seq_length = _max_over([rows, seq_length], group)
    seq_length = -(-seq_length // seq_multiple) * seq_multiple
    return [_trimmed(batch.select(part), seq_length).padded(rows, seq_length) for part in plan]


def local_micro_batches(
    local: ActorBatch, max_tokens_per_micro_batch: int, fp8_recipe: str | None
) -> tuple[list[list[int]], list[ActorBatch]]:
    """This DP rank's rows ``local`` as (plan, padded micro-batches), steps 1 and 2 above.

    The count and the padded shape are agreed over the data-parallel group; the length is a
    multiple of the TP size times the FP8 token alignment (``fp8_recipe``, None without FP8),
    times ``2 * cp`` with context parallelism.
    """
    dp_group = parallel_state.get_data_parallel_group()
    plan = plan_micro_batches(local.lengths.tolist(), max_tokens_per_micro_batch, dp_group)
    multiple = padded_sequence_multiple(
        tp=parallel_state.get_tensor_model_parallel_world_size(),
        fp8_recipe=fp8_recipe,
        cp=parallel_state.get_context_parallel_world_size(),
    )
    return plan, padded_micro_batches(local, plan, dp_group, seq_multiple=multiple)


def _trimmed(batch: ActorBatch, seq_length: int) -> ActorBatch:
    if batch.seq_length <= seq_length:
        return batch
    fields = {
        name: value[:, :seq_length]
        for name in (
            "input_ids",
            "response_mask",
            "old_log_probs",
            "rollout_log_probs",
            "ref_log_probs",
            "routed_experts",
        )
        if (value := getattr(batch, name)) is not None
    }
    if batch.advantages is not None and batch.advantages.dim() == 2:
        fields["advantages"] = batch.advantages[:, :seq_length]
    return batch.replace(**fields)
