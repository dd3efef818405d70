"""Per-token log-probs and entropy of given sequences, forward only.

Shape legend: B sequences, S tokens.

:func:`compute_log_probs` runs this rank's share of a global batch through
the pipeline schedule in token-budget micro-batches (packed or padded, see
``schedule``) and returns the WHOLE batch's [B, S] values (aligned as in
``token_logprobs``) on every rank: the last pipeline stage broadcasts them
over its pipeline group, and the data-parallel ranks' disjoint rows are
summed into one [B, S] tensor (exact: the other ranks contribute zeros).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_rl.actor.batch import ActorBatch
from megatron_rl.actor.batch_partition import dp_shard, padded_micro_batches, plan_micro_batches
from megatron_rl.actor.packing import PackingRule, padded_sequence_multiple
from megatron_rl.actor.routing_replay import RoutingReplay
from megatron_rl.actor.schedule import run_schedule
from megatron_rl.actor.token_logprobs import TokenLogProbs


@torch.no_grad()
def compute_log_probs(
    models: list[torch.nn.Module],
    batch: ActorBatch,
    *,
    vocab_size: int,
    temperature: float,
    max_tokens_per_micro_batch: int,
    packing: PackingRule | None = None,
    replay: RoutingReplay | None = None,
    fp8_recipe: str | None = None,
) -> TokenLogProbs:
    """Log-probs and entropies of every row of the global ``batch``, identical on every rank.

    All ranks must call this together with the same ``batch``. Each DP rank
    computes the rows :func:`dp_shard` gives it. ``temperature`` and
    ``packing``: as in ``run_schedule``; ``fp8_recipe`` (None without FP8) sets the
    padded length's alignment (:func:`padded_sequence_multiple`).
    """
    dp_group = parallel_state.get_data_parallel_group()
    rows = dp_shard(batch.lengths.tolist(), parallel_state.get_data_parallel_rank(), dist.get_world_size(dp_group))
    local = batch.select(rows)
    plan = plan_micro_batches(local.lengths.tolist(), max_tokens_per_micro_batch, dp_group)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    micro_batches = padded_micro_batches(
        local, plan, dp_group, seq_multiple=padded_sequence_multiple(tp=tp, fp8_recipe=fp8_recipe)
    )

    def loss_fn(micro_batch: ActorBatch, current: TokenLogProbs) -> TokenLogProbs:
        return current

    outputs = run_schedule(
        models,
        micro_batches,
        loss_fn,
        vocab_size=vocab_size,
        temperature=temperature,
        forward_only=True,
        packing=packing,
        replay=replay,
    )
    result_2BS = batch.input_ids.new_zeros((2, batch.num_sequences, batch.seq_length), dtype=torch.float32)
    if parallel_state.is_pipeline_last_stage():
        for part, output in zip(plan, outputs, strict=True):
            global_rows = torch.tensor([rows[i] for i in part], device=result_2BS.device)
            width = min(batch.seq_length, output.log_probs.shape[1])
            result_2BS[0, global_rows, :width] = output.log_probs[: len(part), :width].float()
            result_2BS[1, global_rows, :width] = output.entropy[: len(part), :width].float()
    _share(result_2BS)
    return TokenLogProbs(result_2BS[0], result_2BS[1])


def _share(result: torch.Tensor) -> None:
    """Broadcast from the last pipeline stage, then sum the DP ranks' disjoint rows (in place)."""
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        dist.broadcast(
            result,
            src=parallel_state.get_pipeline_model_parallel_last_rank(),
            group=parallel_state.get_pipeline_model_parallel_group(),
        )
    dp_group = parallel_state.get_data_parallel_group()
    if dist.get_world_size(dp_group) > 1:
        dist.all_reduce(result, group=dp_group)
