"""One RL training step: PPO epochs x mini-batches, each one optimizer update.

For every (epoch, mini-batch) each DP rank takes its rows of the mini-batch
(its shard from the driver, or its balanced part of a global batch), cuts them into
token-budget micro-batches (same count and shape on every DP rank),
counted (step-wide valid tokens and sequences, all-reduced over DP), and run
forward-backward through Megatron's schedule with :func:`megatron_loss`;
``finalize_model_grads`` reduces the gradients over DP and divides them by the
token count, then Megatron's distributed optimizer clips and applies them.
Mini-batches are contiguous chunks of the batch in its given order, the same
in every epoch (the driver shuffles before calling, if it wants to).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_rl.actor.batch import ActorBatch
from megatron_rl.actor.batch_partition import dp_shard, local_micro_batches, split_mini_batches
from megatron_rl.actor.fault_injection import poison_gradients_if_asked
from megatron_rl.actor.loss import actor_loss, count_step, megatron_loss
from megatron_rl.actor.metrics import MetricsAccumulator
from megatron_rl.actor.optimizer import OptimizerBundle, step_optimizer
from megatron_rl.actor.packing import PackingRule
from megatron_rl.actor.routing_replay import RoutingReplay
from megatron_rl.actor.schedule import run_schedule
from megatron_rl.actor.token_logprobs import TokenLogProbs
from megatron_rl.config.schema import AlgorithmConfig, TrainConfig

if TYPE_CHECKING:
    from megatron.core.distributed import DistributedDataParallel


@dataclass(frozen=True)
class StepContext:
    """What a training step needs besides the batch (``temperature``, ``packing``: as in ``run_schedule``)."""

    models: Sequence[DistributedDataParallel]
    optimizer: OptimizerBundle
    train: TrainConfig
    algorithm: AlgorithmConfig
    vocab_size: int
    norm_constant: float
    temperature: float
    replay: RoutingReplay | None = None
    packing: PackingRule | None = None


def train_on_batch(context: StepContext, batch: ActorBatch) -> list[dict[str, float]]:
    """Run every update of the step on the global ``batch``; return one metrics dict per update.

    All ranks call this together with the same ``batch``; each DP rank trains on the rows
    :func:`dp_shard` gives it within each mini-batch.
    """
    dp_group = parallel_state.get_data_parallel_group()
    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), dist.get_world_size(dp_group)
    local_mini_batches = []
    for rows in split_mini_batches(batch.num_sequences, context.train.mini_batches_per_step):
        mini_batch = batch.select(rows)
        local_mini_batches.append(mini_batch.select(dp_shard(mini_batch.lengths.tolist(), dp_rank, dp_size)))
    return [
        update_on_mini_batch(context, local) for _ in range(context.train.ppo_epochs) for local in local_mini_batches
    ]


def train_on_local_rows(
    context: StepContext, local: ActorBatch, mini_batches: Sequence[range]
) -> list[dict[str, float]]:
    """Run every update of the step on this DP rank's own rows; one metrics dict per update.

    ``mini_batches``: the rows of ``local`` in each mini-batch (every DP rank has as many).
    """
    return [
        update_on_mini_batch(context, local.select(list(rows)))
        for _ in range(context.train.ppo_epochs)
        for rows in mini_batches
    ]


def update_on_mini_batch(context: StepContext, local: ActorBatch) -> dict[str, float]:
    """One optimizer update on this DP rank's rows ``local`` of a mini-batch; metrics as in ``PolicyActor.train_step``."""
    started = time.perf_counter()
    fp8_recipe = context.train.fp8_recipe if context.train.precision == "fp8" else None
    _, micro_batches = local_micro_batches(local, context.train.max_tokens_per_micro_batch, fp8_recipe)
    counts = count_step(micro_batches, parallel_state.get_data_parallel_group())
    accumulator = MetricsAccumulator()

    def loss_fn(micro_batch: ActorBatch, current: TokenLogProbs) -> tuple[torch.Tensor, torch.Tensor, dict]:
        loss, shares, means = actor_loss(current, micro_batch, counts, context.algorithm, context.norm_constant)
        scaled_loss, local_tokens = megatron_loss(loss, micro_batch, counts)
        accumulator.add(shares, means, local_tokens)
        return scaled_loss, local_tokens, {}

    for model in context.models:
        model.zero_grad_buffer()
    context.optimizer.optimizer.zero_grad()
    run_schedule(
        context.models,
        micro_batches,
        loss_fn,
        vocab_size=context.vocab_size,
        temperature=context.temperature,
        forward_only=False,
        packing=context.packing,
        replay=context.replay,
        chunk_tokens=context.train.logprob_chunk_tokens,
    )
    forward_backward_s = time.perf_counter() - started
    poison_gradients_if_asked(context.models)
    update = step_optimizer(context.optimizer)
    metrics = accumulator.reduce() | update
    return metrics | {
        "num_micro_batches": float(len(micro_batches)),
        "time_forward_backward_s": forward_backward_s,
        "time_update_s": time.perf_counter() - started - forward_backward_s,
    }
