"""Per-token log-probs and entropy of given sequences, forward only.

Shape legend: B sequences, S tokens.

:func:`local_log_probs` runs this data-parallel rank's own rows through the
pipeline schedule in token-budget micro-batches (packed or padded, see
``schedule``) and keeps the [n, S] values (aligned as in ``token_logprobs``) on
the last pipeline stage: the trainer's path, where old and reference log-probs
stay on the rank that trains on them. :func:`compute_log_probs` is the same for
a global batch, every rank returning the WHOLE batch's [B, S] values: the last
pipeline stage broadcasts them over its pipeline group, and the data-parallel
ranks' disjoint rows are summed into one [B, S] tensor (exact: the other ranks
contribute zeros).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_rl.actor.batch import ActorBatch
from megatron_rl.actor.batch_partition import dp_shard, local_micro_batches
from megatron_rl.actor.packing import PackingRule
from megatron_rl.actor.routing_replay import RoutingReplay
from megatron_rl.actor.schedule import run_schedule
from megatron_rl.actor.token_logprobs import TokenLogProbs


@dataclass(frozen=True)
class ForwardOptions:
    """How the actor runs a forward-only pass (each field as in ``run_schedule``).

    ``max_tokens_per_micro_batch``: the token budget of a micro-batch; ``replay``: routing
    replay, or None for the model's own routing (the reference policy); ``fp8_recipe`` (None
    without FP8) sets the padded length's alignment (``packing.padded_sequence_multiple``).
    """

    vocab_size: int
    temperature: float
    max_tokens_per_micro_batch: int
    packing: PackingRule | None = None
    replay: RoutingReplay | None = None
    chunk_tokens: int = 0
    fp8_recipe: str | None = None


@torch.no_grad()
def local_log_probs(
    models: list[torch.nn.Module],
    local: ActorBatch,
    options: ForwardOptions,
) -> TokenLogProbs:
    """[n, S] log-probs and entropies of this data-parallel rank's own rows ``local``.

    All ranks call this together, each DP rank with its rows (every rank of a model-parallel
    group the same). The values are on the last pipeline stage, where the loss uses them; other
    stages get zeros. Nothing is communicated but the micro-batch count and shape (MAX over DP).
    """
    plan, micro_batches = local_micro_batches(local, options.max_tokens_per_micro_batch, options.fp8_recipe)

    def loss_fn(micro_batch: ActorBatch, current: TokenLogProbs) -> TokenLogProbs:
        return current

    outputs = run_schedule(
        models,
        micro_batches,
        loss_fn,
        vocab_size=options.vocab_size,
        temperature=options.temperature,
        forward_only=True,
        packing=options.packing,
        replay=options.replay,
        chunk_tokens=options.chunk_tokens,
    )
    result_2nS = local.input_ids.new_zeros((2, local.num_sequences, local.seq_length), dtype=torch.float32)
    if parallel_state.is_pipeline_last_stage():
        for part, output in zip(plan, outputs, strict=True):
            rows = torch.tensor(part, device=result_2nS.device)
            width = min(local.seq_length, output.log_probs.shape[1])
            result_2nS[0, rows, :width] = output.log_probs[: len(part), :width].float()
            result_2nS[1, rows, :width] = output.entropy[: len(part), :width].float()
    return TokenLogProbs(result_2nS[0], result_2nS[1])


@torch.no_grad()
def compute_log_probs(
    models: list[torch.nn.Module],
    batch: ActorBatch,
    options: ForwardOptions,
) -> TokenLogProbs:
    """Log-probs and entropies of every row of the global ``batch``, identical on every rank.

    All ranks must call this together with the same ``batch``. Each DP rank computes the rows
    :func:`dp_shard` gives it (:func:`local_log_probs`); the results are then shared.
    """
    dp_group = parallel_state.get_data_parallel_group()
    rows = dp_shard(batch.lengths.tolist(), parallel_state.get_data_parallel_rank(), dist.get_world_size(dp_group))
    local = local_log_probs(models, batch.select(rows), options)
    result_2BS = batch.input_ids.new_zeros((2, batch.num_sequences, batch.seq_length), dtype=torch.float32)
    index = torch.tensor(rows, device=result_2BS.device)
    result_2BS[0, index, : local.log_probs.shape[1]] = local.log_probs
    result_2BS[1, index, : local.entropy.shape[1]] = local.entropy
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
