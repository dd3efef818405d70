"""Megatron training state in run checkpoints: exact resume at the same layout, resume at another layout."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from megatron.core import dist_checkpointing
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from megatron_rl.actor.policy_actor import PolicyActor
from megatron_rl.actor.train_step import train_step
from megatron_rl.checkpoint.layout import MEGATRON_DIR
from megatron_rl.checkpoint.megatron_state import load_megatron_state, save_megatron_state
from megatron_rl.parallel.distributed import ParallelSizes, destroy_parallel, initialize_parallel
from tests.actor_setup import (
    algorithm_config,
    fixed_batch,
    rank_shard,
    save_tiny_moe_2layer,
    tiny_actor,
    train_config,
)
from tests.distributed_utils import run_distributed
from tests.tiny_checkpoints import VOCAB

pytestmark = pytest.mark.distributed


@dataclass
class _Run:
    """What rank 0 saw: weights and schedule at the checkpoint, then the next step's loss, lr and weights."""

    weights_at_checkpoint: dict[str, torch.Tensor]
    scheduler_at_checkpoint: dict
    loss: float
    lr: float
    weights_after_step: dict[str, torch.Tensor]


def _actor(sizes: ParallelSizes, hf_dir: Path, *, load_weights: bool) -> PolicyActor:
    initialize_parallel(sizes)
    train = train_config(steps=3, lr=0.05, warmup_steps=2, lr_schedule="cosine", adam_eps=1e-8)
    # train_step's old log-probs are the weights' own (ratio 1, the policy term a constant): the
    # entropy bonus keeps the step's loss a function of the weights it starts from.
    algorithm = algorithm_config(entropy_coef=0.01)
    return tiny_actor(hf_dir, sizes, train=train, algorithm=algorithm, load_weights=load_weights)


def _weights(actor: PolicyActor) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in actor.export_weights()}


def _step_from_checkpoint(actor: PolicyActor, batch, resave_dir: Path | None) -> _Run:
    weights = _weights(actor)
    scheduler = actor.optimizer.scheduler.state_dict()
    if resave_dir is not None:
        save_megatron_state(actor.chunks, actor.optimizer.optimizer, actor.optimizer.scheduler, resave_dir)
    metrics = train_step(actor, rank_shard(batch))
    run = _Run(weights, scheduler, metrics["loss"], metrics["lr"], _weights(actor))
    destroy_parallel()
    return run


def _train_save_train(rank, world_size, sizes, hf_dir, ckpt_dir, batch) -> _Run:
    actor = _actor(sizes, hf_dir, load_weights=True)
    train_step(actor, rank_shard(batch))
    return _step_from_checkpoint(actor, batch, resave_dir=ckpt_dir)


def _save_before_training_then_train(rank, world_size, sizes, hf_dir, ckpt_dir, batch) -> _Run:
    actor = _actor(sizes, hf_dir, load_weights=True)
    return _step_from_checkpoint(actor, batch, resave_dir=ckpt_dir)


def _load_train(rank, world_size, sizes, hf_dir, ckpt_dir, batch, resave_dir=None) -> _Run:
    actor = _actor(sizes, hf_dir, load_weights=False)
    load_megatron_state(actor.chunks, actor.optimizer.optimizer, actor.optimizer.scheduler, ckpt_dir)
    return _step_from_checkpoint(actor, batch, resave_dir)


def _all_ranks(runs: list[_Run]) -> _Run:
    """Rank 0's run with the weights every rank exported (ranks hold different experts and stages)."""
    first = runs[0]
    at_checkpoint = {name: weight for run in runs for name, weight in run.weights_at_checkpoint.items()}
    after_step = {name: weight for run in runs for name, weight in run.weights_after_step.items()}
    return _Run(at_checkpoint, first.scheduler_at_checkpoint, first.loss, first.lr, after_step)


def _checkpoint_tensors(ckpt_dir: Path, scratch: Path) -> dict[str, torch.Tensor]:
    """Every full tensor of the run checkpoint's ``torch_dist`` part, by checkpoint key (read in this process)."""
    dcp_to_torch_save(ckpt_dir / MEGATRON_DIR, scratch)
    return {key: value for key, value in torch.load(scratch, weights_only=False).items() if torch.is_tensor(value)}


def _param_groups_by_identity(ckpt_dir: Path) -> dict[tuple, dict]:
    """The checkpoint's optimizer parameter groups by (wd_mult, lr_mult, max_lr, min_lr), expert flag dropped."""
    groups = dist_checkpointing.load_common_state_dict(str(ckpt_dir / MEGATRON_DIR))["optimizer"]["optimizer"]
    return {
        (group["wd_mult"], group["lr_mult"], group["max_lr"], group["min_lr"]): {
            key: value for key, value in group.items() if key != "is_expert_parallel"
        }
        for group in groups["param_groups"]
    }


def _assert_same_optimizer_state(original: Path, resaved: Path, scratch: Path) -> None:
    """Same per-parameter optimizer tensors (exact, true vocabulary rows) and parameter-group hyperparameters."""
    expected = _checkpoint_tensors(original, scratch / "original.pt")
    actual = _checkpoint_tensors(resaved, scratch / "resaved.pt")
    assert expected.keys() == actual.keys()
    assert any(".exp_avg_sq.decoder.layers.0.mlp.experts." in key for key in expected)
    for key in expected:
        vocab_padded = "word_embeddings" in key or "output_layer" in key
        rows = slice(0, VOCAB) if vocab_padded else slice(None)
        assert torch.equal(actual[key][rows], expected[key][rows]), key
    assert _param_groups_by_identity(resaved) == _param_groups_by_identity(original)


def _assert_resumed_like_straight(straight: _Run, resumed: _Run) -> None:
    """Bitwise weights and equal schedule at the checkpoint; the next step's loss and weights within 1e-5."""
    assert resumed.weights_at_checkpoint.keys() == straight.weights_at_checkpoint.keys()
    for name, weight in straight.weights_at_checkpoint.items():
        assert torch.equal(resumed.weights_at_checkpoint[name], weight), name
    assert resumed.scheduler_at_checkpoint == straight.scheduler_at_checkpoint
    assert resumed.lr == straight.lr
    assert resumed.loss == pytest.approx(straight.loss, rel=0, abs=1e-5)
    for name, weight in straight.weights_after_step.items():
        torch.testing.assert_close(resumed.weights_after_step[name], weight, rtol=0, atol=1e-5, msg=name)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory):
    hf_dir = save_tiny_moe_2layer(tmp_path_factory.mktemp("hf"))
    return hf_dir, fixed_batch()


@pytest.mark.parametrize("sizes", [ParallelSizes(ep=2), ParallelSizes(cp=2, ep=2)], ids=["ep2", "cp2-ep2"])
def test_resume_at_the_same_layout_continues_bitwise(setup, tmp_path: Path, sizes: ParallelSizes) -> None:
    hf_dir, batch = setup
    straight = run_distributed(_train_save_train, 2, sizes, hf_dir, tmp_path, batch)[0]
    resumed = run_distributed(_load_train, 2, sizes, hf_dir, tmp_path, batch)[0]
    assert resumed.lr == straight.lr
    assert resumed.loss == straight.loss
    assert straight.weights_after_step.keys() == resumed.weights_after_step.keys()
    for name, weight in straight.weights_after_step.items():
        assert torch.equal(resumed.weights_after_step[name], weight), name


def test_a_checkpoint_before_the_first_update_saves_and_resumes_bitwise(setup, tmp_path: Path) -> None:
    """Steps whose dynamic sampling kept nothing update nothing: the run still checkpoints and resumes."""
    hf_dir, batch = setup
    sizes = ParallelSizes(ep=2)
    straight = run_distributed(_save_before_training_then_train, 2, sizes, hf_dir, tmp_path, batch)[0]
    resumed = run_distributed(_load_train, 2, sizes, hf_dir, tmp_path, batch)[0]
    assert resumed.lr == straight.lr and resumed.loss == straight.loss
    for name, weight in straight.weights_after_step.items():
        assert torch.equal(resumed.weights_after_step[name], weight), name


def test_resume_at_another_layout_continues_with_the_same_state(setup, tmp_path: Path) -> None:
    hf_dir, batch = setup
    straight = _all_ranks(run_distributed(_train_save_train, 2, ParallelSizes(ep=2), hf_dir, tmp_path, batch))
    resumed = _all_ranks(run_distributed(_load_train, 2, ParallelSizes(tp=2, ep=2, etp=1), hf_dir, tmp_path, batch))
    _assert_resumed_like_straight(straight, resumed)


@pytest.mark.parametrize(
    ("saved_at", "resumed_at"),
    [
        pytest.param(ParallelSizes(tp=2), ParallelSizes(ep=2), id="tp2xep1-to-tp1xep2"),
        pytest.param(ParallelSizes(ep=2), ParallelSizes(pp=2), id="tp1xep2-to-pp2xep1"),
    ],
)
def test_resume_moving_expert_parallel_between_1_and_2_keeps_the_optimizer_state(
    setup, tmp_path: Path, saved_at: ParallelSizes, resumed_at: ParallelSizes
) -> None:
    hf_dir, batch = setup
    original, resaved = tmp_path / "original", tmp_path / "resaved"
    straight = _all_ranks(run_distributed(_train_save_train, 2, saved_at, hf_dir, original, batch))
    resumed = _all_ranks(run_distributed(_load_train, 2, resumed_at, hf_dir, original, batch, resaved))
    _assert_same_optimizer_state(original, resaved, tmp_path)
    _assert_resumed_like_straight(straight, resumed)


def test_resume_from_context_parallel_2_to_1_keeps_the_optimizer_state(setup, tmp_path: Path) -> None:
    """CP shards no parameter, but the distributed optimizer shards its state over DP x CP: CP2 x DP1 -> DP2."""
    hf_dir, batch = setup
    original, resaved = tmp_path / "original", tmp_path / "resaved"
    straight = _all_ranks(run_distributed(_train_save_train, 2, ParallelSizes(cp=2, ep=2), hf_dir, original, batch))
    resumed = _all_ranks(run_distributed(_load_train, 2, ParallelSizes(ep=2), hf_dir, original, batch, resaved))
    _assert_same_optimizer_state(original, resaved, tmp_path)
    _assert_resumed_like_straight(straight, resumed)


def test_loading_a_checkpoint_without_training_state_names_the_missing_part(setup, tmp_path: Path) -> None:
    hf_dir, _ = setup
    with pytest.raises(Exception, match="holds no Megatron training state"):
        run_distributed(_load_train, 1, ParallelSizes(), hf_dir, tmp_path, None)
