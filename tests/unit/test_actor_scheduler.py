"""The LR schedule across a resume: the checkpoint gives the update count, the recipe the schedule."""

from __future__ import annotations

import math

import pytest
import torch
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron_rl.actor.optimizer import build_scheduler
from megatron_rl.config.schema import TrainConfig


def _scheduler(steps: int) -> tuple[torch.optim.Optimizer, OptimizerParamScheduler]:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    train = TrainConfig(steps=steps, lr=1.0, min_lr=0.0, lr_schedule="cosine", prompts_per_step=1)
    return optimizer, build_scheduler(optimizer, train)


def _saved_after_four_updates(steps: int) -> OptimizerParamScheduler:
    _, scheduler = _scheduler(steps)
    for _ in range(4):
        scheduler.step(increment=1)
    return scheduler


def test_a_run_extended_on_resume_continues_its_count_and_decays_over_the_new_total() -> None:
    saved = _saved_after_four_updates(steps=10)
    optimizer, resumed = _scheduler(steps=20)
    resumed.load_state_dict(saved.state_dict())

    assert resumed.num_steps == 4
    expected = 0.5 * (1 + math.cos(math.pi * 4 / 20))
    assert optimizer.param_groups[0]["lr"] == pytest.approx(expected)


def test_an_unchanged_recipe_resumes_to_the_same_learning_rate() -> None:
    saved = _saved_after_four_updates(steps=10)
    optimizer, resumed = _scheduler(steps=10)
    resumed.load_state_dict(saved.state_dict())
    assert optimizer.param_groups[0]["lr"] == saved.optimizer.param_groups[0]["lr"]


def test_warmup_counts_rollout_steps_each_of_mini_batches_times_epochs_updates() -> None:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    train = TrainConfig(
        steps=100, lr=1.0, warmup_steps=20, mini_batches_per_step=16, ppo_epochs=2, prompts_per_step=512
    )
    scheduler = build_scheduler(optimizer, train)
    assert scheduler.lr_warmup_steps == 20 * 16 * 2
    for _ in range(16 * 2):  # the first rollout step
        scheduler.step(increment=1)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1 / 20)
