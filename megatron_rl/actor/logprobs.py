"""Per-token log-probs and entropy of given sequences, forward only.

Shape legend: B sequences, S tokens, V/tp this TP rank's vocabulary slice.

:func:`token_log_probs` turns vocab-parallel logits into [B, S] log-probs and
entropies aligned with the input ids (position t: the distribution predicted
at t - 1; position 0 holds 0). :func:`compute_log_probs` runs this rank's
share of a global batch through the pipeline schedule in token-budget
micro-batches and returns the WHOLE batch's values on every rank: the last
pipeline stage broadcasts them over its pipeline group, and the
data-parallel ranks' disjoint rows are summed into one [B, S] tensor (exact:
the other ranks contribute zeros).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_rl.actor.batch import RolloutBatch
from megatron_rl.actor.microbatching import dp_shard, padded_micro_batches, plan_micro_batches
from megatron_rl.actor.routing_replay import RoutingReplay
from megatron_rl.actor.schedule import run_schedule
from megatron_rl.parallel.vocab_parallel import vocab_parallel_logprobs_entropy


@dataclass(frozen=True)
class TokenLogProbs:
    """Log-probs and entropies (nats) of a batch, [B, S] float32 each, aligned with ``input_ids``."""

    log_probs: torch.Tensor
    entropy: torch.Tensor


def token_log_probs(logits_BSV: torch.Tensor, input_ids_BS: torch.Tensor, vocab_size: int) -> TokenLogProbs:
    """Log-probs of ``input_ids`` and entropies from this TP rank's logits slice (differentiable).

    Columns at or beyond ``vocab_size`` (TP padding of the vocabulary) are excluded.
    """
    group = parallel_state.get_tensor_model_parallel_group()
    log_probs_BS, entropy_BS = vocab_parallel_logprobs_entropy(
        logits_BSV[:, :-1], input_ids_BS[:, 1:], vocab_size=vocab_size, group=group
    )
    first_BS = log_probs_BS.new_zeros((log_probs_BS.shape[0], 1))
    return TokenLogProbs(torch.cat([first_BS, log_probs_BS], dim=1), torch.cat([first_BS, entropy_BS], dim=1))


@torch.no_grad()
def compute_log_probs(
    models: list[torch.nn.Module],
    batch: RolloutBatch,
    *,
    vocab_size: int,
    max_tokens_per_micro_batch: int,
    replay: RoutingReplay | None = None,
) -> TokenLogProbs:
    """Log-probs and entropies of every row of the global ``batch``, identical on every rank.

    All ranks must call this together with the same ``batch``. Each DP rank
    computes the rows :func:`dp_shard` gives it.
    """
    dp_group = parallel_state.get_data_parallel_group()
    rows = dp_shard(batch.lengths.tolist(), parallel_state.get_data_parallel_rank(), dist.get_world_size(dp_group))
    local = batch.select(rows)
    plan = plan_micro_batches(local.lengths.tolist(), max_tokens_per_micro_batch, dp_group)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    micro_batches = padded_micro_batches(local, plan, dp_group, seq_multiple=tp)

    def loss_fn(micro_batch: RolloutBatch, logits: torch.Tensor) -> TokenLogProbs:
        return token_log_probs(logits, micro_batch.input_ids, vocab_size)

    outputs = run_schedule(models, micro_batches, loss_fn, forward_only=True, replay=replay)
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
