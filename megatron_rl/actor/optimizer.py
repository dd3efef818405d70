"""Megatron-core's distributed optimizer and LR schedule, configured from ``TrainConfig``.

* Adam (decoupled weight decay) through ``get_megatron_optimizer`` with
  ``use_distributed_optimizer``: optimizer state and fp32 master weights are
  sharded over data parallel. With bf16 parameters (GPU) the optimizer keeps
  fp32 master copies; with fp32 parameters (CPU tests) it updates them directly.
* Gradient clipping by global norm (``train.grad_clip``; None disables it).
* ``OptimizerParamScheduler``: linear warmup over ``train.warmup_steps`` rollout steps (their updates)
  updates, then constant or cosine decay to ``train.min_lr`` at the last
  update. :func:`step_optimizer` advances the schedule BEFORE each update, so
  update k (1-based) uses the schedule's value at k: the first warmup update
  has lr = lr / warmup_steps rather than 0, and the last update of a cosine
  run uses ``min_lr``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.optimizer import MegatronOptimizer, OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.transformer import TransformerConfig

from megatron_rl.config.schema import TrainConfig


def wrap_ddp(config: TransformerConfig, chunks: Sequence[torch.nn.Module]) -> list[DistributedDataParallel]:
    """Megatron DDP around each chunk: fp32 gradient buffers, sharded for the distributed optimizer.

    ``config.calculate_per_token_loss`` must already be set (DDP reads it to
    choose its gradient scaling). Parameters that require no gradient (the base under LoRA) must be
    frozen before: megatron-core 0.19 gives only the others buffer space, a ``main_grad`` and a gradient
    hook, and :func:`build_optimizer` only them a parameter group, main parameter and Adam state.
    """
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True)
    return [DistributedDataParallel(config, ddp_config, chunk) for chunk in chunks]


def optimizer_config(train: TrainConfig, params_dtype: torch.dtype) -> OptimizerConfig:
    """Megatron ``OptimizerConfig`` for ``train`` (Adam, distributed, clip, decay)."""
    return OptimizerConfig(
        optimizer="adam",
        lr=train.lr,
        min_lr=train.min_lr,
        weight_decay=train.weight_decay,
        adam_beta1=train.adam_beta1,
        adam_beta2=train.adam_beta2,
        adam_eps=train.adam_eps,
        clip_grad=train.grad_clip or 0.0,
        bf16=params_dtype == torch.bfloat16,
        params_dtype=params_dtype,
        use_distributed_optimizer=True,
    )


@dataclass
class OptimizerBundle:
    """The optimizer and its LR/weight-decay schedule."""

    optimizer: MegatronOptimizer
    scheduler: OptimizerParamScheduler


def build_optimizer(
    models: Sequence[torch.nn.Module], train: TrainConfig, params_dtype: torch.dtype
) -> OptimizerBundle:
    """Optimizer over the DDP-wrapped ``models`` and its schedule (:func:`build_scheduler`)."""
    optimizer = get_megatron_optimizer(optimizer_config(train, params_dtype), list(models))
    return OptimizerBundle(optimizer, build_scheduler(optimizer, train))


def updates_per_step(train: TrainConfig) -> int:
    """Optimizer updates of one rollout step: mini-batches x PPO epochs."""
    return train.mini_batches_per_step * train.ppo_epochs


def build_scheduler(
    optimizer: MegatronOptimizer | torch.optim.Optimizer, train: TrainConfig
) -> OptimizerParamScheduler:
    """The LR / weight-decay schedule spanning the run's updates.

    The run has ``train.steps * train.ppo_epochs * train.mini_batches_per_step`` updates;
    ``train.warmup_steps`` counts rollout steps, so the warmup spans that many steps' updates
    (:func:`updates_per_step` each). On resume the recipe's schedule settings win over the
    checkpoint's (a run extended with more ``train.steps`` decays over the new total) and the
    checkpoint supplies the update count.
    """
    num_updates = train.steps * updates_per_step(train)
    warmup_updates = train.warmup_steps * updates_per_step(train)
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if warmup_updates else train.lr,
        max_lr=train.lr,
        min_lr=train.min_lr,
        lr_warmup_steps=warmup_updates,
        lr_decay_steps=max(num_updates, warmup_updates + 1),
        lr_decay_style=train.lr_schedule,
        start_wd=train.weight_decay,
        end_wd=train.weight_decay,
        wd_incr_steps=max(num_updates, 1),
        wd_incr_style="constant",
        override_opt_param_scheduler=True,
        use_checkpoint_opt_param_scheduler=False,
    )


def step_optimizer(bundle: OptimizerBundle) -> dict[str, float]:
    """Advance the schedule, clip and apply the accumulated gradients; return ``lr`` and ``grad_norm``.

    Gradients whose global norm (over every model-parallel rank, so all ranks agree) is NaN or
    infinite are not applied: parameters, optimizer state and the LR schedule stay as they were
    (as Megatron does for an fp16 overflow), ``update_skipped`` is 1.0 and ``grad_norm`` is the
    non-finite norm. The next update zeroes the gradients as usual.
    """
    # The norm reads the optimizer's main gradients, which prepare_grads fills from the model's; step()
    # fills them again: a copy of the same values (no precision here uses fp16's loss scaler, which would
    # unscale twice).
    found_inf = bundle.optimizer.prepare_grads()
    grad_norm = float(bundle.optimizer.get_grad_norm())
    if found_inf or not math.isfinite(grad_norm):
        return {"lr": float(bundle.optimizer.param_groups[0]["lr"]), "grad_norm": grad_norm, "update_skipped": 1.0}
    bundle.scheduler.step(increment=1)
    lr = bundle.optimizer.param_groups[0]["lr"]
    update_successful, _, _ = bundle.optimizer.step()
    return {"lr": float(lr), "grad_norm": grad_norm, "update_skipped": float(not update_successful)}
