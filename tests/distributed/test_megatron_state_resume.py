"""Megatron training state in run checkpoints: exact resume at the same layout, resume at another layout."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_rl.actor import PolicyActor
from megatron_rl.checkpoint.megatron_state import load_megatron_state, save_megatron_state
from megatron_rl.models.hf_config import load_hf_config
from megatron_rl.parallel.distributed import ParallelSizes, destroy_parallel, initialize_parallel
from tests.actor_setup import (
    algorithm_config,
    batch_with_old_log_probs,
    parallel_config,
    save_tiny_moe_2layer,
    train_config,
)
from tests.distributed_utils import run_distributed

pytestmark = pytest.mark.distributed


def _actor(sizes: ParallelSizes, hf_dir: Path, *, load_weights: bool) -> PolicyActor:
    initialize_parallel(sizes)
    return PolicyActor(
        load_hf_config(hf_dir),
        parallel_config(sizes),
        train_config(steps=3, lr=0.05, warmup_steps=2, lr_schedule="cosine", adam_eps=1e-8),
        algorithm_config(),
        norm_constant=16,
        temperature=1.0,
        hf_weights=hf_dir if load_weights else None,
    )


def _weights(actor: PolicyActor) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in actor.export_weights()}


def _train_save_train(rank, world_size, sizes, hf_dir, ckpt_dir, batch):
    actor = _actor(sizes, hf_dir, load_weights=True)
    actor.train_step(batch)
    save_megatron_state(actor.chunks, actor.optimizer.optimizer, actor.optimizer.scheduler, ckpt_dir)
    metrics = actor.train_step(batch)
    result = (_weights(actor), metrics["lr"])
    destroy_parallel()
    return result


def _load_train(rank, world_size, sizes, hf_dir, ckpt_dir, batch):
    actor = _actor(sizes, hf_dir, load_weights=False)
    load_megatron_state(actor.chunks, actor.optimizer.optimizer, actor.optimizer.scheduler, ckpt_dir)
    metrics = actor.train_step(batch)
    result = (_weights(actor), metrics["lr"])
    destroy_parallel()
    return result


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory):
    hf_dir = save_tiny_moe_2layer(tmp_path_factory.mktemp("hf"))
    return hf_dir, batch_with_old_log_probs(hf_dir)


def test_resume_at_the_same_layout_continues_bitwise(setup, tmp_path: Path) -> None:
    hf_dir, batch = setup
    sizes = ParallelSizes(ep=2)
    (straight, lr_straight), _ = run_distributed(_train_save_train, 2, sizes, hf_dir, tmp_path, batch)
    (resumed, lr_resumed), _ = run_distributed(_load_train, 2, sizes, hf_dir, tmp_path, batch)
    assert lr_resumed == lr_straight
    assert straight.keys() == resumed.keys()
    for name in straight:
        assert torch.equal(straight[name], resumed[name]), name


def test_resume_at_another_layout_continues_with_the_same_state(setup, tmp_path: Path) -> None:
    hf_dir, batch = setup
    (straight, lr_straight), _ = run_distributed(_train_save_train, 2, ParallelSizes(ep=2), hf_dir, tmp_path, batch)
    results = run_distributed(_load_train, 2, ParallelSizes(tp=2, ep=2, etp=1), hf_dir, tmp_path, batch)
    resumed, lr_resumed = results[0]
    assert lr_resumed == lr_straight
    for name in straight:
        torch.testing.assert_close(resumed[name], straight[name], rtol=0, atol=1e-5, msg=name)


def test_loading_a_checkpoint_without_training_state_names_the_missing_part(setup, tmp_path: Path) -> None:
    hf_dir, _ = setup
    with pytest.raises(Exception, match="holds no Megatron training state"):
        run_distributed(_load_train, 1, ParallelSizes(), hf_dir, tmp_path, None)
