"""The updates of one RL training step: PPO epochs x mini-batches, each one optimizer update.

:func:`run_updates` is the second half of ``PolicyActor.train_step``: it gets this DP rank's
own rows of the step (its shard from the driver, padded, with the old and reference
log-probs the actor computed for them) and which of those rows form each mini-batch
(``StepData.mini_batch_rows``: the rank's part of each of the step's contiguous
mini-batches, the same in every epoch). For every (epoch, mini-batch) it cuts the rank's
rows of the mini-batch into token-budget micro-batches (same count and shape on every DP
rank), counts the step-wide valid tokens and sequences (all-reduced over DP) and runs
forward-backward through Megatron's schedule with :func:`megatron_loss`;
``finalize_model_grads`` reduces the gradients over DP and divides them by the token count,
then Megatron's distributed optimizer clips and applies them.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from megatron.core import parallel_state

from megatron_rl.actor.batch import ActorBatch
from megatron_rl.actor.batch_partition import local_micro_batches
from megatron_rl.actor.fault_injection import poison_gradients_if_asked
from megatron_rl.actor.loss import actor_loss, count_step, megatron_loss
from megatron_rl.actor.metrics import MetricsAccumulator
from megatron_rl.actor.optimizer import OptimizerBundle, step_optimizer
from megatron_rl.actor.schedule import ForwardOptions, run_schedule
from megatron_rl.actor.token_logprobs import TokenLogProbs
from megatron_rl.config.schema import AlgorithmConfig, TrainConfig

if TYPE_CHECKING:
    from megatron.core.distributed import DistributedDataParallel


@dataclass(frozen=True)
class StepContext:
    """What a training step needs besides its rows: the model, optimizer, recipe and forward options.

    ``forward``: the policy's :class:`ForwardOptions` (with routing replay, if on), the same
    bundle its old log-probs were computed with.
    """

    models: Sequence[DistributedDataParallel]
    optimizer: OptimizerBundle
    train: TrainConfig
    algorithm: AlgorithmConfig
    norm_constant: float
    forward: ForwardOptions


def run_updates(context: StepContext, local: ActorBatch, mini_batches: Sequence[range]) -> list[dict[str, float]]:
    """Every optimizer update of the step on this DP rank's rows ``local``; one metrics dict per update.

    ``local`` carries old log-probs (and reference log-probs with the KL loss) and advantages.
    ``mini_batches``: the rows of ``local`` in each mini-batch (every DP rank has as many, and
    as many rows in each). All ranks call this together.
    """
    return [
        update_on_mini_batch(context, local.select(list(rows)))
        for _ in range(context.train.ppo_epochs)
        for rows in mini_batches
    ]


def update_on_mini_batch(context: StepContext, local: ActorBatch) -> dict[str, float]:
    """One optimizer update on this DP rank's rows ``local`` of a mini-batch; metrics as in ``PolicyActor.train_step``."""
    started = time.perf_counter()
    options = context.forward
    _, micro_batches = local_micro_batches(local, options.max_tokens_per_micro_batch, options.fp8_recipe)
    counts = count_step(micro_batches, parallel_state.get_data_parallel_group())
    accumulator = MetricsAccumulator()

    def loss_fn(
        micro_batch: ActorBatch, current: TokenLogProbs
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        loss, shares, means = actor_loss(current, micro_batch, counts, context.algorithm, context.norm_constant)
        scaled_loss, own_tokens = megatron_loss(loss, micro_batch, counts, parallel_state.get_context_parallel_group())
        accumulator.add(shares, means, micro_batch.response_mask.sum())
        return scaled_loss, own_tokens, {}

    for model in context.models:
        model.zero_grad_buffer()
    context.optimizer.optimizer.zero_grad()
    run_schedule(context.models, micro_batches, loss_fn, options, forward_only=False)
    forward_backward_s = time.perf_counter() - started
    poison_gradients_if_asked(context.models)
    update = step_optimizer(context.optimizer)
    metrics = accumulator.reduce() | update
    return metrics | {
        "num_micro_batches": float(len(micro_batches)),
        "time_forward_backward_s": forward_backward_s,
        "time_update_s": time.perf_counter() - started - forward_backward_s,
    }
