"""One rank's RL training step: old (and reference) log-probs, then PPO epochs x mini-batches of updates.

:func:`train_step` is the whole step on this DP rank's shard of it, as ``TrainerWorker.train_step``
runs it: the shard's rows padded onto the device (``PolicyActor.prepare``), their old (and, with
the KL loss, reference) log-probs computed and kept here (``PolicyActor.batch_log_probs``), then
:func:`run_updates`. Which rows form each mini-batch is ``StepData.mini_batch_rows``: the rank's
part of each of the step's contiguous mini-batches, the same in every epoch. For every (epoch,
mini-batch) :func:`update_on_mini_batch` cuts the rank's rows of the mini-batch into token-budget
micro-batches (same count and shape on every DP rank), counts the step-wide valid tokens and
sequences (all-reduced over DP) and runs forward-backward through Megatron's schedule
(:func:`forward_backward`), whose loss function is this micro-batch's share of the step loss
(``loss.actor_loss``) in Megatron's per-token contract (``loss.megatron_loss``);
``finalize_model_grads`` reduces the gradients over DP and divides them by the token count, then
Megatron's distributed optimizer clips and applies them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_rl.actor.batch import ActorBatch
from megatron_rl.actor.batch_partition import local_micro_batches
from megatron_rl.actor.fault_injection import poison_gradients_if_asked
from megatron_rl.actor.loss import StepCounts, actor_loss, count_step, megatron_loss
from megatron_rl.actor.metrics import MetricsAccumulator
from megatron_rl.actor.micro_batch_forward import (
    ForwardOptions,
    ModelInput,
    model_inputs,
    output_log_probs,
    run_model,
    schedule_shape,
)
from megatron_rl.actor.optimizer import OptimizerBundle, step_optimizer
from megatron_rl.config.schema import AlgorithmConfig, TrainConfig

if TYPE_CHECKING:
    from megatron.core.distributed import DistributedDataParallel

    from megatron_rl.actor.policy_actor import PolicyActor
    from megatron_rl.actor.step_data import StepData

# What Megatron's loss_func returns for a micro-batch: (loss, its token count, log dict).
LossResult = tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]


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


def train_step(actor: PolicyActor, shard: StepData) -> dict[str, float]:
    """The step on this DP rank's own samples ``shard``: old (and reference) log-probs here, then the updates.

    All ranks call this together, every rank of a model-parallel group with the same shard
    and every DP rank with as many samples per mini-batch (``StepData.shard``). The old and
    reference log-probs are those of ``PolicyActor.log_probs`` and stay on this rank. Returns the
    metrics averaged over the step's updates, the same on every rank: ``loss``,
    ``policy_loss``, ``entropy_loss``, ``kl_loss`` (with the KL loss), ``clip_frac_upper``/
    ``lower``/``dual``, ``approx_kl``, ``entropy``, ``ratio_mean``/``max``, ``mismatch_*``/
    ``tis_*`` (with rollout log-probs), ``grad_norm``, ``lr``, ``tokens``,
    ``num_micro_batches``, ``time_forward_backward_s``, ``time_update_s``; plus
    ``num_updates``, ``time_old_log_probs_s`` (``time_ref_log_probs_s`` with the KL loss)
    and ``time_train_s``.
    """
    started = time.perf_counter()
    local = actor.prepare(shard)
    local = local.replace(old_log_probs=actor.batch_log_probs(local, reference=False).log_probs)
    timings = {"time_old_log_probs_s": time.perf_counter() - started}
    if actor.step_context.algorithm.use_kl_loss:
        local = local.replace(ref_log_probs=actor.batch_log_probs(local, reference=True).log_probs)
        timings["time_ref_log_probs_s"] = time.perf_counter() - started - timings["time_old_log_probs_s"]
    trained = time.perf_counter()
    updates = run_updates(actor.step_context, local, shard.mini_batch_rows())
    return _mean_over_updates(updates) | timings | {"time_train_s": time.perf_counter() - trained}


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
    """One optimizer update on this DP rank's rows ``local`` of a mini-batch; metrics as in :func:`train_step`."""
    started = time.perf_counter()
    options = context.forward
    _, micro_batches = local_micro_batches(local, options.max_tokens_per_micro_batch, options.fp8_recipe)
    counts = count_step(micro_batches, parallel_state.get_data_parallel_group())
    accumulator = MetricsAccumulator()
    for model in context.models:
        model.zero_grad_buffer()
    context.optimizer.optimizer.zero_grad()
    forward_backward(context, micro_batches, counts, accumulator)
    forward_backward_s = time.perf_counter() - started
    poison_gradients_if_asked(context.models)
    update = step_optimizer(context.optimizer)
    metrics = accumulator.reduce() | update
    return metrics | {
        "num_micro_batches": float(len(micro_batches)),
        "time_forward_backward_s": forward_backward_s,
        "time_update_s": time.perf_counter() - started - forward_backward_s,
    }


def forward_backward(
    context: StepContext, micro_batches: Sequence[ActorBatch], counts: StepCounts, accumulator: MetricsAccumulator
) -> None:
    """One forward-backward call of Megatron's schedule (no pipelining, 1F1B or interleaved, as the parallel
    state dictates) over ``micro_batches`` (one ``[B, S]`` shape), leaving the gradients in the DDP buffers.

    The loss of a micro-batch is its share of the step loss under ``counts`` (``actor_loss``), scaled for
    Megatron's per-token-loss path (``megatron_loss``); its metrics go into ``accumulator``.
    """
    options = context.forward
    inputs = model_inputs(micro_batches, options.packing)
    cp_group = parallel_state.get_context_parallel_group()

    def forward_step(
        data_iterator: Iterator[ModelInput], model: torch.nn.Module
    ) -> tuple[torch.Tensor, Callable[[torch.Tensor], LossResult]]:
        item = next(data_iterator)
        logits = run_model(model, item, options.replay)

        def loss_func(output: torch.Tensor) -> LossResult:
            micro_batch = item.micro_batch
            current = output_log_probs(output, item, options)
            loss, shares, means = actor_loss(current, micro_batch, counts, context.algorithm, context.norm_constant)
            scaled_loss, own_tokens = megatron_loss(loss, micro_batch, counts, cp_group)
            accumulator.add(shares, means, micro_batch.response_mask.sum())
            return scaled_loss, own_tokens, {}

        return logits, loss_func

    for model in context.models:
        model.train()
    micro_batch_size, seq_length = schedule_shape(inputs)
    # Each model chunk (virtual pipeline stage) gets its own iterator over the inputs.
    iterators = [iter(inputs) for _ in context.models] if len(context.models) > 1 else iter(inputs)
    with options.replaying():
        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iterators,
            model=list(context.models),
            num_microbatches=len(inputs),
            seq_length=seq_length,
            micro_batch_size=micro_batch_size,
            forward_only=False,
        )


def _mean_over_updates(updates: list[dict[str, float]]) -> dict[str, float]:
    """Each metric averaged over the step's optimizer updates, plus ``num_updates``."""
    return {key: sum(update[key] for update in updates) / len(updates) for key in updates[0]} | {
        "num_updates": float(len(updates))
    }
